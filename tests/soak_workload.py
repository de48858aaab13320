"""The soak's workload: the seeded plan, the requests (unique prompts, random lengths and client behaviours),
the client that runs them like a real one (retrying 429/5xx after Retry-After), and the undisturbed reference.
Used by tests/test_soak.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass

import httpx

CHUNK = "32768"  # no prompt of a batch is ever split into chunks
RETRY_STATUSES = (429, 502, 503, 504)


@dataclass(frozen=True)
class SoakPlan:
    """Everything that defines one soak run (the same plan and seed give the same requests and events)."""

    seed: int = 0
    num_requests: int = 60
    concurrency: int = 6
    max_prompt_len: int = 64
    max_new_tokens: int = 12
    p_stream: float = 0.4  # of the requests that run to the end
    p_disconnect: float = 0.1  # streamed, the client leaves after its first chunk(s)
    p_cancel: float = 0.08  # the client gives up after a random 0-300 ms (often before the first token)
    # (fraction of the non-probe requests dispatched, event). "prefill": SIGKILL the prefill while it holds
    # pages of a transfer, restart it on the same port; "decode-K": SIGKILL decode K while it runs requests,
    # restart it on the same port (it comes back with an empty cache)
    chaos: tuple[tuple[float, str], ...] = ((0.2, "prefill"), (0.45, "decode-1"), (0.7, "prefill"))
    transfer_delay_s: float = 0.03  # prefill: before each KV page message (a transfer spans several)
    num_probes: int = 6  # the last requests go out once every worker is healthy again, all at once (plain)
    # clients retry 429/5xx (honouring Retry-After) for up to this long after their first attempt: a killed
    # service's restart takes a process start, tens of seconds on a loaded 2-core machine
    retry_window_s: float = 90.0
    page_size: int = 4

    @classmethod
    def full(cls, seed: int = 1, num_requests: int = 1000) -> SoakPlan:
        events = ("prefill", "decode-1", "prefill", "decode-0")
        n = 10
        return cls(seed=seed, num_requests=num_requests, concurrency=8, max_prompt_len=96, max_new_tokens=16,
                   chaos=tuple(((i + 0.5) / n, events[i % len(events)]) for i in range(n)))


@dataclass
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    kind: str  # "plain" | "stream" | "disconnect" | "cancel"
    cancel_after_s: float = 0.0


@dataclass
class Outcome:
    kind: str  # "completed" | "disconnected" | "cancelled" | "failed"
    text: str = ""
    status: int = 0
    attempts: int = 0
    error: str = ""


def make_jobs(plan: SoakPlan, vocab_size: int) -> list[Job]:
    """The plan's requests; the last ``num_probes`` are plain (they check that restarted workers serve again)."""
    rng = random.Random(plan.seed)
    seen: set[tuple[int, ...]] = set()
    jobs = []
    for i in range(plan.num_requests):
        while True:  # unique prompts that share no first page: no request hits another's cache
            prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, plan.max_prompt_len))]
            if tuple(prompt[:plan.page_size]) not in seen:
                seen.add(tuple(prompt[:plan.page_size]))
                break
        r = rng.random()
        kind = ("disconnect" if r < plan.p_disconnect else "cancel" if r < plan.p_disconnect + plan.p_cancel
                else "stream" if rng.random() < plan.p_stream else "plain")
        if i >= plan.num_requests - plan.num_probes:
            kind = "plain"
        jobs.append(Job(i, prompt, rng.randint(1, plan.max_new_tokens), kind, rng.uniform(0.0, 0.3)))
    return jobs


def engine_args(model_dir: str, page_size: int) -> tuple[str, ...]:
    return ("--model", model_dir, "--device", "cpu", "--dtype", "float32", "--page-size", str(page_size),
            "--chunked-prefill-size", CHUNK)


class Reference:
    """The undisturbed greedy outputs, rendered into text exactly as the router does."""

    def __init__(self, model_dir: str, page_size: int) -> None:
        from engine.config import CacheConfig, EngineConfig, SchedulerConfig
        from engine.engine import Engine

        self.engine = Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32",
                                          cache=CacheConfig(kv_dtype="nvfp4", page_size=page_size,
                                                            max_total_tokens=1 << 16),
                                          scheduler=SchedulerConfig(chunk_size=int(CHUNK))))

    def _sampling(self, job: Job, max_tokens: int | None = None):
        from engine.sampling import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens or job.max_tokens)

    def text(self, job: Job, ids: list[int]) -> str:
        from tokenization.tokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.engine.tokenizer, prompt_ids=job.prompt, skip_special_tokens=True)
        return "".join(detok.push(t) for t in ids) + detok.flush()

    def fresh(self, jobs: list[Job]) -> dict[int, str]:
        """Path 1 for every prompt (unique prompts, one batch, never chunked)."""
        self.engine.cache.flush()
        outs = self.engine.generate([j.prompt for j in jobs], [self._sampling(j) for j in jobs])
        return {j.index: self.text(j, o.token_ids) for j, o in zip(jobs, outs, strict=True)}

    def cached_prefix(self, job: Job) -> str:
        """The output when the prompt's full pages are already cached (what a prefill that kept the prompt of a
        failed attempt computes on the retry)."""
        self.engine.cache.flush()
        self.engine.generate([job.prompt], [self._sampling(job, max_tokens=1)])  # caches the prompt's pages
        out = self.engine.generate([job.prompt], [self._sampling(job)])[0]
        self.engine.cache.flush()
        return self.text(job, out.token_ids)


# -- the client side --------------------------------------------------------------------------------------------

def _retry_after(resp: httpx.Response) -> float:
    try:
        return min(2.0, max(0.2, float(resp.headers.get("retry-after", "0.5"))))
    except ValueError:
        return 0.5


async def _stream_once(client: httpx.AsyncClient, body: dict, leave_after: int | None) -> tuple[int, str, str, float]:
    """(status, text, error, retry_after) of one streamed attempt; leave_after: disconnect after that many
    text chunks (status -1 when the client left)."""
    text, chunks = [], 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, "", resp.text, _retry_after(resp)
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return 200, "".join(text), "", 0.0
            event = json.loads(data)
            if "error" in event:
                return 503, "", event["error"]["message"], 0.5  # after the first byte: an error event
            for choice in event.get("choices", []):
                if choice.get("text"):
                    text.append(choice["text"])
                    chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return -1, "".join(text), "", 0.0  # leaving the block closes the connection
    return 502, "", "stream ended without [DONE]", 0.5


async def run_job(client: httpx.AsyncClient, job: Job, plan: SoakPlan, model: str) -> Outcome:
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0}
    if job.kind == "disconnect":
        status, text, err, _ = await _stream_once(client, body, leave_after=1)
        if status == -1:
            return Outcome("disconnected", text, status, 1)
        return Outcome("completed" if status == 200 else "failed", text, status, 1, err)
    if job.kind == "cancel":
        task = asyncio.ensure_future(client.post("/v1/completions", json=body))
        done, _ = await asyncio.wait({task}, timeout=job.cancel_after_s)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Outcome("cancelled", attempts=1)
        resp = task.result()
        if resp.status_code == 200:
            return Outcome("completed", resp.json()["choices"][0]["text"], 200, 1)
        return Outcome("failed", "", resp.status_code, 1, resp.text)
    deadline = time.monotonic() + plan.retry_window_s
    for attempt in itertools.count(1):
        if job.kind == "stream":
            status, text, err, wait = await _stream_once(client, body, None)
        else:
            resp = await client.post("/v1/completions", json=body)
            status, wait = resp.status_code, _retry_after(resp)
            text, err = (resp.json()["choices"][0]["text"], "") if status == 200 else ("", resp.text)
        if status == 200:
            return Outcome("completed", text, 200, attempt)
        last = Outcome("failed", "", status, attempt, err)
        if status not in RETRY_STATUSES or time.monotonic() + wait > deadline:
            return last
        await asyncio.sleep(wait)
