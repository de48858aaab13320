#!/bin/bash
# poll.sh SECONDS: wait (returning early once pipeline.sh is done), print its stage lines and the log's tail, and
# pack /tmp/res (logs, docs/benchmarks copies) into $OUT/res.tgz.
end=$(( $(date +%s) + $1 ))
while [ $(date +%s) -lt $end ] && [ ! -f /tmp/res/DONE ]; do sleep 5; done
grep "^===" /tmp/res/pipeline.log; echo ---; tail -n 25 /tmp/res/pipeline.log
cd /tmp/res && tar czf $OUT/res.tgz --exclude='*.safetensors' . 2>/dev/null; ls -la $OUT
