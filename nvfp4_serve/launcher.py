"""`nvfp4-serve up`: a router, N prefill services and M decode services on this machine.

Each service is its own process (as in a multi-host deployment), started with free loopback
ports; the launcher waits until the router's /health is green, prints the URL, and on Ctrl-C
(SIGINT) or SIGTERM stops every child, or stops them all when any one of them dies; with
``--restart on-failure`` it starts a failed child again on its port (with backoff) and the router
takes it back once it is healthy. The children end with the launcher, even when it is killed
(``nvfp4_serve/supervisor.py``).

GPU memory when services share a GPU: the prefill services start first, each with a KV pool sized
for the prompts it has in flight (``--prefill-max-total-tokens``, default twice the workspace);
the decode services start once the prefills are ready and size their pools from the memory still
free, so that ``--mem-fraction-static F`` (or ``--max-total-tokens``) means the same as in a
colocated run: the decode gets the rest of F. Each service logs its pool in tokens. A decode that shares
its GPU with a prefill paces its decode steps while it waits for pulled prompts
(``--shared-gpu-decode-interval-ms``): the prefill then computes at nearly its full speed, and the decode's
inter-token latency sits near that interval until the last prompt has arrived.

``--num-prefill 0`` starts no prefill service: the decode services run the prompts themselves
(colocated). The router admits as many requests at once as the decode services run together
(``--max-running-requests`` x ``--num-decode``), so that it is not the tighter limit, and balances
prompts over the prefill services by outstanding tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from nvfp4_serve.supervisor import RESTART_POLICIES, Child, stop_all, supervise
from nvfp4_serve.supervisor import spawn as _spawn
from svc_common.cli_help import HelpFormatter, add_version
from svc_common.engine_args import add_engine_args, engine_args_to_argv, engine_config_from_args
from svc_common.free_port import free_port
from svc_common.kv_transfer import TRANSFER_MODES
from svc_common.model_source import hub_id_of
from svc_common.preflight import check_device, prepare_engine_args
from svc_common.service_auth import API_KEY_ENV, SERVICE_TOKEN_ENV
from svc_common.tls import TLSConfig, add_tls_args, check_handshake, tls_argv, tls_from_args

SHARED_GPU_DECODE_INTERVAL_MS = 26.0  # the step starts 26 ms apart; a step that waits behind a prefill kernel adds ~15 ms: p99 under 40 ms


def gpu_envs(env: dict[str, str], prefill_gpus: str | None, decode_gpus: str | None,
             num_decode: int, num_prefill: int = 1) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Child environments placing each prefill and each decode service on their GPUs (CUDA_VISIBLE_DEVICES);
    None leaves a child's visibility as inherited. Prefill i gets the (i mod count)-th prefill id, decode i
    the (i mod count)-th decode id."""
    def parse(spec: str, flag: str) -> list[str]:
        ids = [x.strip() for x in spec.split(",") if x.strip()]
        if not ids or not all(x.isdigit() for x in ids):
            raise SystemExit(f"{flag} takes GPU ids like 0 or 1,2, got {spec!r}")
        return ids

    def place(spec: str | None, flag: str, n: int) -> list[dict[str, str]]:
        envs = [dict(env) for _ in range(n)]
        if spec is not None:
            ids = parse(spec, flag)
            for i, e in enumerate(envs):
                e["CUDA_VISIBLE_DEVICES"] = ids[i % len(ids)]
        return envs

    return place(prefill_gpus, "--prefill-gpus", num_prefill), place(decode_gpus, "--decode-gpus", num_decode)


def shares_gpu(decode_env: dict[str, str], prefill_envs: list[dict[str, str]]) -> bool:
    """Whether a decode service placed by ``decode_env`` runs on the GPU of one of the prefill services (same
    CUDA_VISIBLE_DEVICES, or both inheriting this process's: both use its first visible GPU)."""
    mine = decode_env.get("CUDA_VISIBLE_DEVICES")
    return any(e.get("CUDA_VISIBLE_DEVICES") == mine for e in prefill_envs)


def prefill_pool_tokens(explicit: int | None, workspace_tokens: int | None, context_len: int | None,
                        chunk_size: int) -> int | None:
    """KV pool tokens of each prefill service: ``explicit`` when given, else room for two prompts of the
    workspace's size (one being computed while the previous one's last pages go out); None (the engine
    sizes it from memory) when neither the workspace nor the context is known. A prefill holds a prompt's
    pages only until they have been sent, so it never needs the decode's capacity."""
    if explicit is not None:
        if explicit < chunk_size:
            raise SystemExit(f"--prefill-max-total-tokens {explicit} is below --chunked-prefill-size {chunk_size}")
        return explicit
    ws = workspace_tokens or context_len
    return None if ws is None else 2 * ws


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("nvfp4-serve up", description=__doc__, formatter_class=HelpFormatter)
    add_version(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="router bind address (default: loopback only; 0.0.0.0 listens on the network)")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--num-decode", type=int, default=1, help="decode services to start")
    p.add_argument("--num-prefill", type=int, default=1,
                   help="prefill services to start (default 1), or 0 for none (the decode services run the "
                        "prompts themselves: colocated)")
    p.add_argument("--prefill-gpus", default=None,
                   help="GPU ids for the prefill services, e.g. 0 or 0,1 (prefill i gets id i mod count; sets "
                        "their CUDA_VISIBLE_DEVICES; default: the visibility this command inherited)")
    p.add_argument("--prefill-max-total-tokens", type=int, default=None,
                   help="KV pool of each prefill service in tokens (default: twice --workspace-tokens, else twice "
                        "the model context): prompts in flight there; the decode services get the rest")
    p.add_argument("--decode-gpus", default=None,
                   help="GPU ids for the decode services, e.g. 1 or 1,2 (decode i gets id i mod count; default: the "
                        "visibility this command inherited)")
    p.add_argument("--shared-gpu-decode-interval-ms", type=float, default=SHARED_GPU_DECODE_INTERVAL_MS,
                   help="where a decode service shares its GPU with a prefill service, its decode steps start at "
                        "least this far apart while prompts are pulled, so the prefill computes at nearly full "
                        "speed (inter-token latency then sits near this value; 0: off)")
    p.add_argument("--kv-transfer", default="auto", choices=TRANSFER_MODES,
                   help="passed to the prefill and decode services: how KV pages travel between them (auto, grpc, "
                        "cuda-ipc, or nixl: NIXL over UCX, needs the nixl extra)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on the API (or ${API_KEY_ENV}); also the service "
                        f"token of every gRPC link unless --service-token is given; default: no key)")
    p.add_argument("--metrics-open", action="store_true",
                   help="serve the router's /metrics without the API key (it names the services' addresses)")
    p.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the hub id of --model, else its directory's name)")
    p.add_argument("--restart", default="no", choices=RESTART_POLICIES,
                   help="no: a service that dies stops the deployment; on-failure: it is started again on its "
                        "port, after 1 s doubling to 30 s when it keeps failing, and the router routes to it "
                        "once it is healthy")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds until every service is ready and the router healthy")
    p.add_argument("--log-level", default="info", help="log level of every service")
    p.add_argument("--prefill-metrics-port", type=int, default=None, metavar="PORT",
                   help="Prometheus metrics over HTTP: prefill i on PORT+i (default: none)")
    p.add_argument("--decode-metrics-port", type=int, default=None, metavar="PORT",
                   help="Prometheus metrics over HTTP: decode i on PORT+i (default: none)")
    for svc, cmd in (("prefill", "prefill"), ("decode", "decode"), ("router", "router")):
        p.add_argument(f"--{svc}-args", default="", metavar="'ARGS'",
                       help=f"more flags for every {svc} service, one shell-quoted string, e.g. "
                            + ("'--between-tokens-timeout 300'" if svc == "decode" else
                               "'--kv-hold-timeout 120'" if svc == "prefill" else "'--queue-timeout-s 30'")
                            + f" (see nvfp4-serve {cmd} --help)")
    add_tls_args(p)
    add_engine_args(p)
    return p


def _wait_ready(children: list[Child], deadline: float) -> None:
    for c in children:
        while not c.ready.wait(0.2):
            if c.popen.poll() is not None:
                c.output_done.wait(5)  # its output read to the end: its error line is known
                why = f": {c.last_error}" if c.last_error else ""
                raise RuntimeError(f"{c.name} exited with code {c.popen.returncode} during start-up{why}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{c.name} not ready in time")


def _wait_health(url: str, router: Child, deadline: float) -> None:
    why = "no answer"
    while time.monotonic() < deadline:
        if router.popen.poll() is not None:
            raise RuntimeError(f"router exited with code {router.popen.returncode} during start-up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:  # 503: which worker is down and why (e.g. a TLS handshake failure)
            try:
                why = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError, OSError):
                why = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            why = str(e)
        time.sleep(0.2)
    raise TimeoutError(f"router /health did not turn green in time: {why}")


def _context_len(model_dir: str) -> int | None:
    """The checkpoint's context length (config.json only), or None when it cannot be read here."""
    from engine.model_config import ModelConfig

    try:
        return ModelConfig.from_dir(model_dir).max_context_len
    except (OSError, ValueError, KeyError):
        return None


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == flag:
            skip = True
        else:
            out.append(x)
    return out


def _split_args(flag: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ValueError(f"{flag} {text!r}: {e} (give the flags as one shell-quoted string)") from None


def _metrics_argv(base: int | None, i: int) -> list[str]:
    """``--metrics-port base+i`` for the i-th service of a kind, or nothing."""
    return [] if base is None else ["--metrics-port", str(base + i)]


def _check_args(a: argparse.Namespace) -> tuple[bool, dict[str, list[str]], TLSConfig]:
    """Every flag checked once, before any child starts (SystemExit with one line): whether the services run on a
    GPU, each kind's extra flags (``--prefill-args`` ...) and the TLS links. ``a.model`` is resolved in place."""
    if a.num_decode < 1:
        raise SystemExit("--num-decode must be >= 1")
    if a.num_prefill < 0:
        raise SystemExit("--num-prefill must be >= 0")
    if not 0 <= a.shared_gpu_decode_interval_ms <= 1000:
        raise SystemExit(f"nvfp4-serve up: --shared-gpu-decode-interval-ms must be in [0, 1000] (0: decode steps are never paced), "
                         f"got {a.shared_gpu_decode_interval_ms:g}")
    if a.num_prefill == 0 and a.prefill_gpus is not None:
        raise SystemExit("--prefill-gpus places the prefill service, but --num-prefill 0 starts none: drop one")
    try:
        a.served_model_name = a.served_model_name or hub_id_of(a.model)  # the API names a hub model by its id
        prepare_engine_args(a)  # --model resolved once (a hub id becomes its cached directory), then checked
        on_gpu = check_device(a.device) != "cpu"
        engine_config_from_args(a)  # every engine flag value checked here, not once per child
        extra = {svc: _split_args(f"--{svc}-args", getattr(a, f"{svc}_args")) for svc in ("prefill", "decode", "router")}
        links = tls_from_args(a)
        if links.enabled:  # every child dials the others on loopback: a certificate that fails there fails now
            check_handshake(links, "127.0.0.1")
    except ValueError as e:
        raise SystemExit(f"nvfp4-serve up: {e}") from None
    return on_gpu, extra, links


def _prefill_argv(a: argparse.Namespace, common: list[str]) -> list[str]:
    """The engine flags of every prefill service: no host tier (it is the decodes' cache), its own pool size."""
    prefill_argv = _drop_flag(common, "--host-cache-size")
    pool = prefill_pool_tokens(a.prefill_max_total_tokens, a.workspace_tokens,
                               a.context_length or _context_len(a.model), a.chunk_size)
    if pool is not None:
        prefill_argv = [*_drop_flag(prefill_argv, "--max-total-tokens"), "--max-total-tokens", str(pool)]
    return prefill_argv


def _start_prefills(a: argparse.Namespace, argv: list[str], envs: list[dict[str, str]],
                    extra: list[str]) -> tuple[list[Child], list[int]]:
    """The prefill services, started (not yet ready), and their ports."""
    names = ["prefill"] if a.num_prefill == 1 else [f"prefill-{i}" for i in range(a.num_prefill)]
    ports = [free_port() for _ in names]
    prefills = [_spawn(name, ["-m", "prefill_svc", "--port", str(port), *argv,
                              *_metrics_argv(a.prefill_metrics_port, i), *extra], envs[i])
                for i, (name, port) in enumerate(zip(names, ports, strict=True))]
    return prefills, ports


def _pacing_argv(a: argparse.Namespace, shared: bool) -> list[str]:
    """``--decode-interval-while-pulling-ms`` for a decode on the GPU of a prefill (``shared``), or nothing."""
    if shared and a.shared_gpu_decode_interval_ms:
        return ["--decode-interval-while-pulling-ms", f"{a.shared_gpu_decode_interval_ms:g}"]
    return []


def _router_argv(a: argparse.Namespace, decodes: list[Child], prefills: list[Child], tls: list[str],
                 extra: list[str]) -> list[str]:
    router_argv = ["-m", "router", "--host", a.host, "--port", str(a.port), "--model-dir", a.model,
                   "--decode-addresses", *[d.address for d in decodes],
                   "--max-concurrent-requests", str(a.max_running_requests * a.num_decode),
                   "--log-level", a.log_level, *tls]
    if prefills:
        router_argv += ["--prefill-addresses", *[p.address for p in prefills]]
    if a.metrics_open:
        router_argv.append("--metrics-open")
    if a.served_model_name:
        router_argv += ["--served-model-name", a.served_model_name]
    if a.context_length:
        router_argv += ["--max-model-len", str(a.context_length)]
    return router_argv + extra


def _ready_line(a: argparse.Namespace, url: str, prefills: list[Child]) -> str:
    prefill_text = (f"{len(prefills)} prefill ({', '.join(p.address for p in prefills)})" if prefills
                    else "no prefill: decode runs the prompts")
    layers_text = "" if a.num_layers is None else f", --num-layers {a.num_layers}"
    return (f"nvfp4-serve ready: {url}/v1  (model {a.model}, kv {a.kv_cache_dtype}{layers_text}, "
            f"{a.num_decode} decode, {prefill_text}); Ctrl-C stops")


def up(argv: list[str] | None = None) -> int:
    a = build_arg_parser().parse_args(argv)
    on_gpu, extra, links = _check_args(a)
    tls = tls_argv(links)  # the same certificate files for every child (server and client)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if links.service_token:  # through the environment: flags show in `ps`
        env[SERVICE_TOKEN_ENV] = links.service_token
    common = [*engine_args_to_argv(a), "--log-level", a.log_level, *tls, "--kv-transfer", a.kv_transfer]
    children: list[Child] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deadline = time.monotonic() + a.startup_timeout
        prefill_envs, decode_envs = gpu_envs(env, a.prefill_gpus, a.decode_gpus, a.num_decode, a.num_prefill)
        prefills, ports = _start_prefills(a, _prefill_argv(a, common), prefill_envs, extra["prefill"])
        children += prefills
        # On a GPU the decodes size their pools from what the prefills left free, so they start once the
        # prefills are ready; on the CPU nothing is shared and every service starts at once.
        parallel = not on_gpu and not any(f in extra["prefill"] for f in ("--host", "--port"))
        if not parallel:
            _wait_ready(prefills, deadline)
        addresses = [f"127.0.0.1:{port}" for port in ports] if parallel else [p.address for p in prefills]
        allowed = ["--prefill-addresses", *addresses] if prefills else []
        shared = [on_gpu and bool(prefills) and shares_gpu(e, prefill_envs) for e in decode_envs]
        decodes = [_spawn(f"decode-{i}", ["-m", "decode_svc", "--port", str(free_port()), *common, *allowed,
                                          *_pacing_argv(a, shared[i]), *_metrics_argv(a.decode_metrics_port, i),
                                          *extra["decode"]], decode_envs[i]) for i in range(a.num_decode)]
        children += decodes
        _wait_ready(prefills + decodes, deadline)
        router = _spawn("router", _router_argv(a, decodes, prefills, tls, extra["router"]),
                        {**env, API_KEY_ENV: a.api_key} if a.api_key else env)
        children.append(router)
        url = f"http://{a.host}:{a.port}"
        _wait_health(url, router, deadline)
        print(_ready_line(a, url, prefills), flush=True)
        return supervise(children, stop, a.restart)
    except (RuntimeError, TimeoutError) as e:
        print(f"nvfp4-serve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_all(children)
        print("nvfp4-serve: stopped", flush=True)
