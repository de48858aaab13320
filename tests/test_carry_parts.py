"""benchmarks/device/carry_parts.sh: a file split into parts, the parts gathered over separate "calls", joined back
bit-identical once all are there, and refused (nothing left behind) while one is missing or corrupt."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device" / "carry_parts.sh"


def _run(tmp_path: Path, *args: str, parts: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CARRY_STORE": str(tmp_path / "store"), "CARRY_PARTS": str(parts)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_parts_gathered_over_calls_join_to_the_same_bytes(tmp_path):
    src = tmp_path / "big.whl"
    src.write_bytes(os.urandom(3 * 1024 * 1024 + 123))
    made = tmp_path / "made"
    assert _run(tmp_path, "split", str(src), "1", parts=made).returncode == 0
    names = sorted(p.name for p in made.iterdir())
    assert names == [f"big.whl.part-0{i}" for i in range(4)] + ["big.whl.sha256"]
    out = tmp_path / "out"
    out.mkdir()
    for i, part in enumerate(names[:4]):  # one part (and the checksum) per call, as a device call carries them
        call = tmp_path / f"call{i}"
        call.mkdir()
        for n in (part, "big.whl.sha256"):
            (call / n).write_bytes((made / n).read_bytes())
        assert _run(tmp_path, "collect", parts=call).returncode == 0
        joined = _run(tmp_path, "join", "big.whl", str(out), parts=call)
        assert (joined.returncode == 0) == (i == 3), joined.stdout + joined.stderr
        assert (out / "big.whl").exists() == (i == 3)  # a partial join leaves nothing behind
    assert (out / "big.whl").read_bytes() == src.read_bytes()
    (tmp_path / "store" / "big.whl.part-01").write_bytes(b"corrupt")
    (out / "big.whl").unlink()
    assert _run(tmp_path, "join", "big.whl", str(out), parts=made).returncode != 0
    assert not (out / "big.whl").exists()
