"""benchmarks/transfer/nixl_probe.py: settings parse as the probe's rows name them, UCX's protocol tables are
reduced to the get/put rows between the two processes, and a tiny CPU run (DRAM, two settings) gives one
verified row per setting with what UCX selected.

The CPU run is skipped, saying why, where nixl cannot be imported or its UCX agent cannot start; nixl is only
ever loaded in child processes (see tests/test_kv_transfer_nixl.py for why).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.transfer.nixl_probe import (
    page_order,
    pages_for,
    parse_setting,
    probe_args,
    selected,
    ucx_lines,
)

_PROBE = """
from nixl._api import nixl_agent, nixl_agent_config
nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
"""

# what UCX_PROTO_INFO=y prints for a READ of VRAM that misses cuda_ipc (the H200 symptom), then an AM table
UCX_LOG = """\
[1.0] [h:1:0]      ucp_worker.c:1997 UCX  INFO    dec intra-node cfg#1 rma_am(tcp/lo)  am(tcp/lo cuda_ipc/cuda)  ka(tcp/lo)
[1.1] [h:1:0]   +--------+--------------------+-----------------------+
[1.1] [h:1:0]   | dec self cfg#0                                      |
[1.1] [h:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.1] [h:1:0]   +--------+--------------------+-----------------------+
[1.1] [h:1:0]   | 0..inf | zero-copy          | self/memory           |
[1.1] [h:1:0]   +--------+--------------------+-----------------------+
[1.2] [h:1:0]   +--------+--------------------+-----------------------+
[1.2] [h:1:0]   | dec intra-node cfg#1                                |
[1.2] [h:1:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda |
[1.2] [h:1:0]   +--------+--------------------+-----------------------+
[1.2] [h:1:0]   | Range  | Description        | Config                |
[1.2] [h:1:0]   +--------+--------------------+-----------------------+
[1.2] [h:1:0]   | 0..inf | software emulation | tcp/lo                |
[1.2] [h:1:0]   +--------+--------------------+-----------------------+
[1.2] [h:1:0]   +--------+--------------------+-----------------------+
[1.2] [h:1:0]   | dec intra-node cfg#1                                |
[1.2] [h:1:0]   | active message by ucp_am_send* from host memory     |
[1.2] [h:1:0]   +--------+--------------------+-----------------------+
[1.2] [h:1:0]   | 0..inf | short              | tcp/lo                |
[1.2] [h:1:0]   +--------+--------------------+-----------------------+
"""


def test_settings_are_default_or_key_value_words():
    assert parse_setting("default") == {}
    assert parse_setting("UCX_TLS=cuda_ipc,cuda_copy,tcp UCX_RNDV_THRESH=0") == {
        "UCX_TLS": "cuda_ipc,cuda_copy,tcp", "UCX_RNDV_THRESH": "0"}
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_setting("UCX_TLS")
    with pytest.raises(ValueError, match="READ or WRITE"):
        parse_setting("NIXL_PROBE_OP=PUSH")
    split = parse_setting("NIXL_PROBE_RUNS=4 NIXL_PROBE_LAYERS=8 NIXL_PROBE_DESCS=32 NIXL_PROBE_POLL_S=0")
    assert probe_args(split) == {"op": "READ", "runs": 4, "layers_per_xfer": 8, "descs_per_read": 32, "poll_s": 0.0,
                                 "busy": False}
    for bad in ("NIXL_PROBE_RUNS=0", "NIXL_PROBE_LAYERS=9", "NIXL_PROBE_DESCS=-1", "NIXL_PROBE_POLL_S=soon", "NIXL_PROBE_BUSY=2"):
        with pytest.raises(ValueError, match="must be"):
            parse_setting(bad)
    with pytest.raises(ValueError, match="READs only"):
        parse_setting("NIXL_PROBE_OP=WRITE NIXL_PROBE_DESCS=8")


def test_page_order_moves_every_page_once_in_runs_of_consecutive_pages():
    order = page_order(10, 3)
    assert sorted(order) == list(range(10))
    assert order == [7, 8, 9, 3, 4, 5, 6, 0, 1, 2]  # blocks [0..2], [3..6], [7..9] land in reverse block order
    assert page_order(5, 1) == list(range(5))


def test_302_mb_is_2048_pages_of_the_8_layer_nvfp4_pool():
    assert pages_for(302) == 2048


def test_ucx_lines_keep_the_lane_config_and_the_peer_get_table_only():
    lines = ucx_lines(UCX_LOG)
    assert lines[0].startswith("ucp_worker.c:1997 UCX  INFO    dec intra-node cfg#1")
    assert any("into cuda/GPU0" in s for s in lines)
    assert not any("self cfg#0" in s or "ucp_am_send" in s for s in lines)
    assert selected(lines) == "get(cuda/GPU0) 0..inf: software emulation [tcp/lo]"


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    probe = subprocess.run([sys.executable, "-c", _PROBE], check=False, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        pytest.skip(f"nixl cannot be imported or its UCX agent cannot start here ({why[:300]}); "
                    "install the nixl extra")
    d = tmp_path_factory.mktemp("nixl_probe")
    out = d / "probe.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.transfer.nixl_probe", "--device", "cpu", "--mb", "8", "--iters", "2",
         "--timeout-s", "90", "--settings", "default", "UCX_TLS=tcp,self",
         "NIXL_PROBE_RUNS=3 NIXL_PROBE_LAYERS=8 NIXL_PROBE_DESCS=5 NIXL_PROBE_POLL_S=0 NIXL_PROBE_BUSY=1",
         "NIXL_PROBE_OP=WRITE NIXL_PROBE_RUNS=3 NIXL_PROBE_LAYERS=4", "--out", str(out),
         "--log-dir", str(d / "logs")],
        check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(out.read_text()), out, run.stdout


def test_cpu_run_gives_one_verified_row_per_setting(cpu_report):
    report, out, stdout = cpu_report
    assert [r["setting"] for r in report["rows"]][:2] == ["default", "UCX_TLS=tcp,self"]
    assert report["pages"] == pages_for(8) and report["bytes"] == pages_for(8) * 8 * 18432
    plain, split, write = report["rows"][:2], report["rows"][2], report["rows"][3]
    for r in report["rows"]:  # every page verified where the setting's order puts it
        assert r["status"] == "ok", r["status"]
        assert r["verified"] and r["verified_each"] == [True, True, True]
        assert r["gbps"] > 0 and len(r["transfer_ms"]) == 2
        assert r["sys"]["initiator"]["ucx_version"][0].isdigit()
    for r in plain:
        assert r["op"] == "READ" and len(r["xfer_ms"]) == 2 * 8
        assert r["descs_per_xfer"] == 4  # one per part: every page is one run
        assert "get(host)" in r["selected"], r["selected"]
    assert "tcp" in report["rows"][1]["selected"]
    # 3 runs x 4 parts x 8 layers in one xfer, read as READs of 5 descriptors posted together
    assert split["op"] == "READ" and split["descs_per_xfer"] == 96 and len(split["xfer_ms"]) == 2
    assert len(split["rounds"]) == 2 and write["rounds"] == [0] * 4
    assert write["op"] == "WRITE" and write["descs_per_xfer"] == 48 and len(write["xfer_ms"]) == 2 * 2
    assert out.with_suffix(".ucx.txt").read_text().count("=== ") == 4
    assert "default" in stdout and "GB/s" in stdout
