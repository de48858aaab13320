#!/bin/bash
# The H200 runs behind docs/benchmarks, in order, in the background so that they outlive
# one device call (each call is limited to 10 minutes; the machine stays held while calls follow each other):
#
#   device call 1:  setsid nohup bash benchmarks/device/pipeline.sh >/dev/null 2>&1 </dev/null & \
#                   sleep 2; bash benchmarks/device/poll.sh 560
#   device call 2+: bash benchmarks/device/poll.sh 560        (until the log says ALL DONE)
#
# Needs, carried as git-ignored folders: .gpu-carry (FlashInfer, from ../shared/tools/gpu-carry) and .whl (wheels
# the GPU image lacks: grpcio>=1.85.1, grpcio-health-checking, grpcio-reflection, protobuf>=7.35.1, fastapi and
# its needs incl. opentelemetry-api, starlette, pydantic, pydantic_core, annotated-types, annotated-doc,
# typing-inspection, typing_extensions, uvicorn; py-spy for stage spy). Results land in docs/benchmarks of a copy under /tmp/w and
# are packed by poll.sh into $OUT/res.tgz. STAGES (default: all) picks stages, e.g. STAGES="model issue7".
R=/tmp/res; mkdir -p $R
exec >>$R/pipeline.log 2>&1
SRC="$(cd "$(dirname "$0")/../.." && pwd)"
rm -rf /tmp/w && cp -r "$SRC" /tmp/w && cd /tmp/w   # later calls re-sync the checkout; work on a copy
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
source .gpu-carry/activate
export PYTHONPATH=/tmp/site:/tmp/w FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
STAGES=${STAGES:-"kernels engine model issue5 issue7 issue5_1m ramp issue9 gpu_unit profile transfer pd tests"}  # file order; issue9x2 needs 2 GPUs; tma_probe, tma_ncu, tma_ncu_bytes, tma_sanitize, gemv_probe, transfer_ahead, one_user, engine_direct, itl_check, spy, engine_blocksel, engine_nofused, engine_rotation, large_eval, iso_capacity, host_copy, transfer_big, transfer_thread, transfer_alt are on demand
TESTS=${TESTS:-tests}  # the GPU tests to run, e.g. TESTS=tests/test_decode_graphs.py
want() { [[ " $STAGES " == *" $1 "* ]]; }
stage() { local name=$1; shift; want "$name" || return 0
  echo "=== $(date +%T) stage $name start"; timeout "$@"; echo "=== $(date +%T) stage $name rc=$?"
  rm -rf $R/docs_final && cp -r docs/benchmarks $R/docs_final; }  # what is done survives a cut-off run
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
# NIXL (stages nixl, nixl_probe), installed here, before the GPU tests, so they take nixl as a third transfer path.
# Either .nixl-slim/nixl-slim.tar.xz (7.4 MiB: benchmarks/device/slim_nixl.py cuts the wheels down to what one host's
# transfers load), or the whole nixl-cu13 wheel (56 MiB), its parts over consecutive calls
# (benchmarks/device/carry_parts.sh, whose header says how; NIXL_WHEEL names it). The tree, .whl and .gpu-carry
# fill one call's 64 MiB, so .nixl-slim goes in a call of its own just before (carry .nixl-slim and .whl, run
# "mkdir -p /tmp/site && tar -xJf .nixl-slim/nixl-slim.tar.xz -C /tmp/site"): a NIXL already in /tmp/site is used.
NIXL_OK=0
if { want nixl || want nixl_probe; } && [ -f .nixl-slim/nixl-slim.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .nixl-slim/nixl-slim.tar.xz -C /tmp/site && NIXL_OK=1
elif { want nixl || want nixl_probe; } && PYTHONPATH=/tmp/site python3 -c "import nixl" 2>/dev/null; then
  NIXL_OK=1
elif want nixl || want nixl_probe; then
  NIXL_WHEEL=${NIXL_WHEEL:-nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl}
  bash benchmarks/device/carry_parts.sh collect >/dev/null
  mkdir -p /tmp/nixlwhl && cp -f /tmp/carry-parts/nixl-*.whl /tmp/nixlwhl/ 2>/dev/null
  if bash benchmarks/device/carry_parts.sh join "$NIXL_WHEEL" /tmp/nixlwhl; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/nixlwhl/*.whl && NIXL_OK=1
  fi
fi
# the GPU tests first: a broken GPU path shows before any benchmark spends time on it
stage tests 420 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m gpu $TESTS  # CPU-only files whose imports (openai, cryptography) the image lacks do not stop it
stage kernels 900 python3 -m benchmarks.kernels.bench_decode ${KERNELS_ARGS:-} --out docs/benchmarks/kernels.json
# the TMA-fed Gluon decode variant against the committed kernel (checks, then both timed in alternation)
stage tma_probe 480 python3 -m benchmarks.kernels.probe_tma ${TMA_PROBE_ARGS:-} --out $R/probe_tma.json
# on demand: Nsight Compute on the default decode (NCU_LAUNCH_ARGS="--launch-config 32:2:32:lean": that config) and its merge at four shapes (84 x 32K: the lean step's least efficient goal point on an H100) (occupancy, issue, stalls, pipes, DRAM; clocks left alone)
stage tma_ncu 540 bash -c 'for sh in 44x32768 10x163840 128x4096 84x32768; do PATH=$PATH:/usr/local/cuda/bin ncu --clock-control none \
  --kernel-name regex:"merge|nvfp4_decode" --launch-skip 4 --launch-count 2 --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
  --csv --page details python3 -m benchmarks.kernels.probe_tma --launch-only $sh ${NCU_LAUNCH_ARGS:-} > '$R'/ncu_$sh.csv; done'
# on demand: the decode's DRAM bytes against the bytes it must read (dram__bytes_read against the pool's pages, L2
# sectors the TMA requests, L2 hit rate); by default the GPU's own config, the lean step at 32 programs per SM and
# the kept step at 12
# (NCU_BYTES_CONFIGS: the --launch-config values, space-separated, "default" for the GPU's own)
stage tma_ncu_bytes 400 bash -c 'for c in ${NCU_BYTES_CONFIGS:-default 32:2:32:lean 32:2:12}; do cfg=; [ "$c" = default ] || cfg="--launch-config $c"; for sh in 44x32768 84x32768 10x163840 128x4096; do \
  PATH=$PATH:/usr/local/cuda/bin ncu --clock-control none --kernel-name regex:nvfp4_decode --launch-skip 2 --launch-count 1 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum \
  --csv python3 -m benchmarks.kernels.probe_tma --launch-only $sh $cfg; done; done > '$R'/ncu_bytes.csv 2>&1'
# on demand: our skinny linear against cuBLAS on the step's projections at 1 / 16 / 44 rows (36 calls per graph)
stage gemv_probe 400 python3 -m benchmarks.kernels.probe_gemv --out $R/probe_gemv.json
# on demand: the TMA variant's checks alone under compute-sanitizer (its first run faulted with an illegal instruction)
stage tma_sanitize 300 bash -c "PATH=\$PATH:/usr/local/cuda/bin compute-sanitizer --tool memcheck --print-limit 20 \
  python3 -m benchmarks.kernels.probe_tma --check-only --out $R/probe_tma_check.json"
ENGINE_SHAPES=${ENGINE_SHAPES:-"1x32768 16x32768 44x32768 48x32768 84x32768 10x163840 1x1048576"}
# (ENGINE_ARGS adds flags, e.g. "--pdl-modes on off": each shape with and without programmatic dependent launch)
stage engine ${ENGINE_TIMEOUT_S:-400} python3 -m benchmarks.engine.bench_decode_step --shapes $ENGINE_SHAPES --iters 8 \
  --profile ${ENGINE_ARGS:-} --out docs/benchmarks/engine_decode.json --md docs/benchmarks/engine_decode.md
# the rest of the step alone, each layer's decode attention replaced by one small kernel: nothing of FlashInfer is
# compiled, so it is the quick check of the non-attention work (about a minute), with and without PDL; its pool holds
# only the pages the step writes, so every shape fits where the weights do (DIRECT_ARGS=--profile: its kernels)
stage engine_direct 300 python3 -m benchmarks.engine.bench_decode_step --only-without-attention \
  --shapes ${DIRECT_SHAPES:-1x32768 16x32768 44x32768} --iters 8 --pdl-modes on off ${DIRECT_ARGS:-} \
  --out docs/benchmarks/engine_decode_direct.json --md docs/benchmarks/engine_decode_direct.md
# the same shapes with the decoder's PyTorch ops instead of the fused kernels (the before/after of the same run)
stage engine_nofused 400 python3 -m benchmarks.engine.bench_decode_step --shapes $ENGINE_SHAPES --iters 8 --no-fused \
  --linear-modes cublas \
  --out docs/benchmarks/engine_decode_nofused.json --md docs/benchmarks/engine_decode_nofused.md
# nvfp4 with the per-block scale search in its pool writes (triton-block-select): the step's cost of the search
stage engine_blocksel 300 python3 -m benchmarks.engine.bench_decode_step --shapes 1x32768 16x32768 44x32768 --iters 8 \
  --kv-dtypes nvfp4 --block-select --profile --out docs/benchmarks/engine_decode_block_select.json \
  --md docs/benchmarks/engine_decode_block_select.md
# nvfp4 and fp8 steps unrotated and with --kv-rotation hadamard in one process: the rotation's cost per step
stage engine_rotation 300 python3 -m benchmarks.engine.bench_decode_step --shapes ${ROTATION_SHAPES:-1x32768 16x32768 44x32768} \
  --iters 8 --kv-dtypes nvfp4 fp8_e4m3 --kv-rotations none hadamard --out docs/benchmarks/engine_decode_rotation.json \
  --md docs/benchmarks/engine_decode_rotation.md
# the host tier's store / load rates per batch size against a raw pinned copy of the same bytes
stage host_copy 200 python3 -m benchmarks.engine.bench_host_tier --out docs/benchmarks/host_tier_copy.json \
  --md docs/benchmarks/host_tier_copy.md
# a larger model trained here with the project's trainer (head_dim 128, GQA 4; results only, not shipped), then the
# accuracy report of docs/benchmarks/accuracy.md on it: every KV variant, standard errors over windows
stage large_eval 590 bash -c "python3 -m offline.train all --out /tmp/big --hidden 1024 --intermediate 2816 \
  --layers 8 --heads 8 --kv-heads 2 --head-dim 128 --device cuda --time-budget-s ${LARGE_TRAIN_S:-200} \
  && python3 -m nvfp4_serve.cli eval --model /tmp/big --device cuda --dtype float32 \
  --json docs/benchmarks/accuracy_large.json --markdown docs/benchmarks/accuracy_large.md"
stage model 240 python3 -m nvfp4_serve.cli make-model /tmp/q8b --preset qwen3-8b --device cuda
stage issue5 900 python3 -m nvfp4_serve.cli bench experiments --kv-dtypes bf16 fp8_e4m3 nvfp4 \
  --iso 32768:40 163840:8 --capacity-input-lens 32768 --sweep-concurrency 1 4 16 --sweep-input-len 32768 \
  --output-len 1024 --point-timeout-s 150 --no-progress --launch-log-dir $R/logs5 \
  --launch --model /tmp/q8b --num-layers 8 --num-prefill 0 --mem-fraction-static 0.22 --workspace-tokens 262144 \
  --chunked-prefill-size 8192
# the serving benchmark's iso-capacity point alone (stage issue5 runs it with the rest; fp8 and nvfp4 at the largest concurrency each pool holds, 32K in / 1K out)
stage iso_capacity 560 python3 -m nvfp4_serve.cli bench experiments --kv-dtypes fp8_e4m3 nvfp4 \
  --capacity-input-lens 32768 --output-len 1024 --point-timeout-s 150 --no-progress --launch-log-dir $R/logs_cap \
  --out docs/benchmarks/serving_iso_capacity.json --report docs/benchmarks/serving_iso_capacity.md --launch \
  --model /tmp/q8b --num-layers 8 --num-prefill 0 --mem-fraction-static 0.22 --workspace-tokens 262144 \
  --chunked-prefill-size 8192
# one nvfp4 point of issue5 (32K x 40) to check ITL after an engine-loop change, without the full sweep
stage itl_check 400 python3 -m nvfp4_serve.cli bench experiments --kv-dtypes nvfp4 --iso 32768:40 --output-len 1024 \
  --point-timeout-s 150 --no-progress --launch-log-dir $R/logs_itl --out docs/benchmarks/serving_itl_check.json \
  --report docs/benchmarks/serving_itl_check.md --launch --model /tmp/q8b --num-layers 8 --num-prefill 0 \
  --mem-fraction-static 0.22 --workspace-tokens 262144 --chunked-prefill-size 8192
if want issue7; then
  stage issue7 90 python3 -m nvfp4_serve.cli bench gen-trace --out docs/benchmarks/agentic_trace_h200.jsonl \
    --num-sessions 48 --output-median 32 --output-max 128 --fit-pool-tokens 393216 --saturate-at 12 \
    --turns-to-fill 12 --think-time-scale 0.05 --seed 0
  stage issue7 900 python3 -m nvfp4_serve.cli bench --trace docs/benchmarks/agentic_trace_h200.jsonl \
    --concurrency 6 12 18 24 32 40 --sessions-per-concurrency 1 --max-point-duration-s 40 \
    --kv-dtypes fp8_e4m3 nvfp4 --equal-pool-bytes 393216 --no-progress --out docs/benchmarks/agentic.json \
    --report docs/benchmarks/agentic.md --launch-log $R/agentic.launch.log \
    --launch --model /tmp/q8b --num-layers 8 --num-prefill 0 --page-size 16
fi
# NIXL between two processes on the H200 (UCX's CUDA transports): the probe of UCX settings, the transfer paths
# side by side, and (NIXL_PD=1, the default) PD serving over cuda-ipc vs nixl.
if [ "$NIXL_OK" = 1 ]; then
  stage nixl_probe 300 python3 -m benchmarks.transfer.nixl_probe --device cuda --out docs/benchmarks/nixl_probe.json \
    --log-dir $R/logs_nixl_probe ${NIXL_PROBE_ARGS:-}
  # every path of stage transfer plus nixl, into the same report (run one of the two stages); NIXL_TRANSFER_ARGS
  # adds to or overrides its flags (e.g. "--paths cuda-ipc nixl --out-json ... --out-md ...")
  stage nixl 600 python3 -m benchmarks.transfer.bench_transfer --prefill-gpu 0 --decode-gpu 0 --model /tmp/q8b \
    --num-layers 8 --lengths 32768 --paths grpc grpc-lanes cuda-ipc nixl --log-dir $R/logs_nixl ${NIXL_TRANSFER_ARGS:-}
  if [ "${NIXL_PD:-1}" = 1 ]; then
    stage nixl 600 python3 -m nvfp4_serve.cli bench pd --input-len 32768 --output-len 256 --concurrency 16 \
      --num-prompts 32 --deployments pd-ipc pd-nixl --out docs/benchmarks/pd_nixl.json \
      --report docs/benchmarks/pd_nixl.md --log-dir $R/logs_pd_nixl --launch --model /tmp/q8b --num-layers 8 \
      --max-total-tokens 1048576 --workspace-tokens 262144 --chunked-prefill-size 8192
  fi
fi
# the agentic trace with and without a host tier (HOSTTIER_SIZES; 32 GB is about 5x the GPU pool, and the
# trace's 48 sessions need ~34 GB of FP8 pages), at two concurrencies of the sweep (HOSTTIER_CONCURRENCY); a
# point lasts HOSTTIER_POINT_S (at 40 s some 50-270 turns of C=40 are never sent, so the sessions stop short of
# their full context: NVFP4's pool then still holds every session); HOSTTIER_DTYPES, HOSTTIER_TIMEOUT_S;
# HOSTTIER_UP_ARGS: more `nvfp4-serve up` flags (e.g. --host-copy-path staged)
stage hosttier ${HOSTTIER_TIMEOUT_S:-600} python3 -m nvfp4_serve.cli bench --trace docs/benchmarks/agentic_trace_h200.jsonl \
  --concurrency ${HOSTTIER_CONCURRENCY:-24 40} --sessions-per-concurrency 1 --max-point-duration-s ${HOSTTIER_POINT_S:-40} \
  --kv-dtypes ${HOSTTIER_DTYPES:-fp8_e4m3 nvfp4} --equal-pool-bytes 393216 --host-cache-sizes ${HOSTTIER_SIZES:-0 32GB} --no-progress \
  --out docs/benchmarks/${HOSTTIER_OUT:-agentic_host_tier}.json --report docs/benchmarks/${HOSTTIER_OUT:-agentic_host_tier}.md \
  --launch-log $R/agentic_host.launch.log --launch --model /tmp/q8b --num-layers 8 --num-prefill 0 --page-size 16 \
  ${HOSTTIER_UP_ARGS:-}
# 1M input (+1,024 output = the model's 1,048,576 context) at concurrency 1: the workspace must hold the whole
# prompt, so it grows to 1M tokens (2 GiB FP8, +1.5 GiB) and --mem-fraction-static grows by 1.5/140 to keep the
# fp8/nvfp4 pools as large as in issue5; bf16 cannot hold 1M in that memory. No warmup (it would be a 2nd 1M prefill).
stage issue5_1m 1000 python3 -m nvfp4_serve.cli bench experiments --kv-dtypes fp8_e4m3 nvfp4 --iso 1047552:1 \
  --output-len 1024 --warmup 0 --point-timeout-s 900 --no-progress --launch-log-dir $R/logs1m \
  --out docs/benchmarks/serving_1m.json --report docs/benchmarks/serving_1m.md \
  --launch --model /tmp/q8b --num-layers 8 --num-prefill 0 --mem-fraction-static 0.231 --workspace-tokens 1048576 \
  --chunked-prefill-size 8192
# on demand: one user at 32K on all 36 layers, nvfp4 and fp8, overlap scheduling on and off (the decode step's
# host work with the GPU idle against hidden behind the step in flight): TPOT and tok/s per user
stage one_user 560 python3 -m nvfp4_serve.cli bench pd --input-len 32768 --output-len 256 --concurrency 1 \
  --num-prompts 3 --warmup 1 --deployments colocated colocated-sync colocated-fp8 colocated-fp8-sync \
  --out docs/benchmarks/one_user.json --report docs/benchmarks/one_user.md --log-dir $R/logs_one_user \
  --launch --model /tmp/q8b --max-total-tokens 262144 --workspace-tokens 65536 --chunked-prefill-size 8192
stage ramp 200 python3 -m benchmarks.engine.bench_ttft_ramp --model /tmp/q8b --num-layers 8 --num-prompts 40 \
  --input-len 32768 --chunk-size 8192 --mem-fraction-static 0.22 --workspace-tokens 262144 \
  --out docs/benchmarks/engine_ttft_ramp.json
stage issue9 400 python3 -m benchmarks.transfer.bench_transfer --prefill-gpu 0 --decode-gpu 0 --log-dir $R/logs9
# Disaggregated prefill/decode: every transfer path against its anchor (raw grpcio, device gather) on the
# 8-layer Qwen3-8B shape at 32K, then the serving comparison colocated vs PD (cuda-ipc, gRPC; nvfp4, fp8).
stage gpu_unit 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kv_copy.py
stage profile 200 python3 -m benchmarks.transfer.profile_copy --out docs/benchmarks/transfer_profile.json \
  --trace $R/transfer_profile_trace.txt
stage transfer 600 python3 -m benchmarks.transfer.bench_transfer --prefill-gpu 0 --decode-gpu 0 --model /tmp/q8b \
  --num-layers 8 --lengths 32768 --paths ${TRANSFER_PATHS:-grpc grpc-lanes cuda-ipc} --log-dir $R/logs_tr ${TRANSFER_ARGS:-}
# on demand: the gRPC path with EXPORTS_AHEAD page exports in flight per transfer (--kv-exports-ahead), nvfp4 only,
# beside stage transfer run with TRANSFER_ARGS="--kv-dtypes nvfp4 --paths grpc grpc-lanes" (its default, 3)
stage transfer_ahead 400 python3 -m benchmarks.transfer.bench_transfer --prefill-gpu 0 --decode-gpu 0 --model /tmp/q8b \
  --num-layers 8 --lengths 32768 --kv-dtypes nvfp4 --paths grpc grpc-lanes --kv-exports-ahead ${EXPORTS_AHEAD:-6} \
  --log-dir $R/logs_tr_ahead --out-json docs/benchmarks/transfer_exports_ahead.json \
  --out-md docs/benchmarks/transfer_exports_ahead.md
# on demand: an A/B of two builds on one lease: stage transfer's command again, on a copy of this tree with the files
# under ALT_DIR (a folder of this tree mirroring its paths, e.g. alt/svc_common/page_export.py, carried untracked)
# laid over it; TRANSFER_ALT_ARGS names its outputs (absolute paths under /tmp/w/docs/benchmarks, so they are kept)
stage transfer_alt 600 bash -c 'test -n "$ALT_DIR" && test -d "/tmp/w/$ALT_DIR" && rm -rf /tmp/alt && cp -r /tmp/w /tmp/alt \
  && cp -r "/tmp/w/$ALT_DIR"/. /tmp/alt/ && cd /tmp/alt && PYTHONPATH=/tmp/site:/tmp/alt python3 -m benchmarks.transfer.bench_transfer \
  --prefill-gpu 0 --decode-gpu 0 --model /tmp/q8b --num-layers 8 --lengths 32768 --paths ${TRANSFER_PATHS:-grpc} \
  --log-dir '$R'/logs_tr_alt ${TRANSFER_ALT_ARGS:-}'
# on demand: the gRPC path sent by the prefill's engine process itself (--kv-sender thread), beside stage transfer's
# sender process: the before/after of the same run
stage transfer_thread 600 python3 -m benchmarks.transfer.bench_transfer --prefill-gpu 0 --decode-gpu 0 --model /tmp/q8b \
  --num-layers 8 --lengths 32768 --paths grpc --kv-sender thread --log-dir $R/logs_tr_thread \
  --out-json docs/benchmarks/transfer_grpc_thread.json --out-md docs/benchmarks/transfer_grpc_thread.md
# on demand: the gRPC path with 16 MiB messages (its raw grpcio anchor at the same size), beside stage transfer's
stage transfer_big 600 python3 -m benchmarks.transfer.bench_transfer --prefill-gpu 0 --decode-gpu 0 --model /tmp/q8b \
  --num-layers 8 --lengths 32768 --paths grpc --message-bytes 16777216 --log-dir $R/logs_tr_big \
  --out-json docs/benchmarks/transfer_grpc_16mib.json --out-md docs/benchmarks/transfer_grpc_16mib.md
# where the gRPC transfer's CPU time goes, per process and thread (py-spy: its wheel in .whl for that run; with
# the 64 MiB carry limit, the web wheels fastapi/pydantic/starlette/uvicorn can stay out, this stage needs none)
stage spy 300 python3 -m benchmarks.transfer.spy_transfer --model /tmp/q8b --num-layers 8 --length 32768 \
  --seconds ${SPY_SECONDS:-5} --rate 250 --grpc-lanes ${SPY_LANES:-1} --log-dir $R/logs_spy
stage pd 1500 python3 -m nvfp4_serve.cli bench pd --input-len 32768 --output-len 256 --concurrency 16 \
  --num-prompts 32 --deployments ${PD_DEPLOYMENTS:-colocated pd-ipc pd-grpc pd-grpc-fp8 pd-ipc-unpaced} --log-dir $R/logs_pd --launch --model /tmp/q8b --num-layers 8 --max-total-tokens 1048576 \
  --workspace-tokens 262144 --chunked-prefill-size 8192
# issue 9 on the two-GPU kind (nvidia-h200-x2): prefill on GPU 0, decode on GPU 1 (the NVLink hop), then the
# serving path through the launcher's GPU placement.
stage issue9x2 400 python3 -m benchmarks.transfer.bench_transfer --prefill-gpu 0 --decode-gpu 1 --log-dir $R/logs9x2
stage issue9x2 600 python3 -m nvfp4_serve.cli bench run --input-len 32768 --output-len 256 --concurrency 8 \
  --num-prompts 16 --no-progress --out docs/benchmarks/serving_two_gpu.json --launch-log $R/two_gpu.launch.log \
  --launch --model /tmp/q8b --num-layers 8 --prefill-gpus 0 --decode-gpus 1 --mem-fraction-static 0.5
echo "=== ALL DONE $(date +%T)"
touch $R/DONE
