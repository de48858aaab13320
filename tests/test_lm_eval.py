"""lm-eval-harness's `local-completions` model against `nvfp4-serve up --num-prefill 0` on a small task written
here (a YAML task over a local JSONL file: no downloads, HF_DATASETS_OFFLINE=1, the checkpoint's own tokenizer):
every loglikelihood lm-eval reports equals a float32 Hugging Face forward of the same token ids. Needs the
`eval` extra (`pip install -e .[eval]`); skipped without lm_eval."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.service_procs import Launched

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval-harness is not installed (pip install -e .[eval])")
transformers = pytest.importorskip("transformers")

DOCS = [{"context": "def add(a, b):", "continuation": " return a + b"},
        {"context": "import os\nimport", "continuation": " sys"},
        {"context": "for i in range(10):", "continuation": "\n    print(i)"}]
TASK = """task: nvfp4_tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
TOL = 2e-2  # the served K/V are bf16, the reference's float32


@pytest.mark.slow
def test_lm_eval_local_completions_loglikelihoods_equal_a_reference_forward(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    from lm_eval.tasks import TaskManager

    dep = Launched("--model", tiny_model_dir, "--num-prefill", "0", "--page-size", "4", "--kv-cache-dtype", "bf16",
                   "--context-length", "128")
    try:
        model_id = httpx.get(f"{dep.url}/v1/models").json()["data"][0]["id"]
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=["nvfp4_tiny_ll"], task_manager=TaskManager(include_path=str(tmp_path)),
            model_args=f"model={model_id},base_url={dep.url}/v1/completions,tokenizer={tiny_model_dir},"
                       f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,"
                       f"max_length=128", log_samples=True)
    finally:
        dep.stop()
    samples = out["samples"]["nvfp4_tiny_ll"]
    assert len(samples) == len(DOCS)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for s in samples:
        context, continuation = s["arguments"][0]
        ll, is_greedy = s["filtered_resps"][0]
        # lm-eval's own split: the whole text's ids, the context's ids, the continuation the rest
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        n_ctx = len(tok(context, add_special_tokens=False).input_ids)
        with torch.no_grad():
            lp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
        want = sum(float(lp[p - 1, whole[p]]) for p in range(n_ctx, len(whole)))
        greedy = all(int(lp[p - 1].argmax()) == whole[p] for p in range(n_ctx, len(whole)))
        assert ll == pytest.approx(want, abs=TOL * (len(whole) - n_ctx)), (context, continuation)
        assert bool(is_greedy) == greedy
