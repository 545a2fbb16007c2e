#!/bin/bash
# The GPU checks in one run (benchmarks/RESULTS.md section 9): the CUDA tests, the training-step table,
# pskv train with --amp on the GPU, one and two replicas in one process, the timeline picture.
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh          # from the repository root, on a machine with CUDA
# DEV=cpu BATCH=4 STEPS=1 EPOCHS=1 checks the script itself on a machine without one. BASE=<dir of another
# checkout> adds that checkout's pskv rows, for a comparison on the same machine. PARTS picks the sections, in
# the order given (default: all but cluster and sweep): step tests amp devices timeline flat cluster sweep; `flat` times
# the payload as per-parameter and as flat keys from GPU tensors (benchmarks/flat_keys.py, RESULTS.md section 26); `cluster` runs
# benchmarks/cluster_1gbit.py (4 + 4 hosts in network namespaces, 1 Gbit links) where root can make them: a
# device machine's cores are the first on which its hosts do not share two cores (RESULTS.md section 10); `sweep`
# runs it with five other settings of PSKV_CHUNK_BYTES and PSKV_WINDOW_BYTES (one run takes a minute).
# Seen on an H200 (16 cores; RESULTS.md sections 24 and 29): step about 90 s for its 10 rows (REPEAT=3: the rows in turn
# three times, about 270 s, as one row varies 20 % and more between runs), tests 15 s, flat about 40 s, cluster about 60 s;
# sweep about 150 s by its five extra pskv runs (section 29 ran its first two as --try rows: about 50 s with the defaults' row).
# A lease is 15 minutes with about a minute to start: PARTS="step tests flat sweep" REPEAT=2 should fit one call (~8 min).
# The device image has no iproute2: carry this machine's ip and tc in .ipr/ (git-ignored), made here with
#   mkdir -p .ipr/bin .ipr/lib && cp /usr/sbin/ip /usr/sbin/tc .ipr/bin/ && ldd /usr/sbin/ip /usr/sbin/tc | awk '/=>/{print $3}' | grep -v -e libc.so -e libm.so | sort -u | xargs -I{} cp -L {} .ipr/lib/
export PYTHONUNBUFFERED=1
[ -d .ipr ] && mkdir -p /tmp/ipr && for t in ip tc; do printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' $PWD/.ipr/lib $PWD/.ipr/bin/$t > /tmp/ipr/$t; chmod +x /tmp/ipr/$t; done && export PATH=$PATH:/tmp/ipr
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/pyzmq*.whl  # (a machine without pyzmq: its wheel in .whl/)
export PYTHONPATH=/tmp/site:$PWD OUT=${OUT:-/tmp/gpu}
mkdir -p $OUT
DEV=${DEV:-cuda}; B=${BATCH:-128}; S=${STEPS:-30}; E=${EPOCHS:-2}
R=/tmp/runs; mkdir -p $R
exec > >(tee $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, os; print(torch.__version__, len(os.sched_getaffinity(0)), 'cores')"
tests() {
echo "== CUDA tests"
timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" --tb=short tests/unit/test_cuda.py tests/unit/test_kv_semantics.py::test_device_store_on_cuda 2>&1 | tail -15
}
step() {
echo "== train_step"
timeout ${STEP_TIMEOUT:-$((100 * ${REPEAT:-1} + 40))} python3 benchmarks/train_step.py --device $DEV --batch $B -n 2 -s 2 --steps $S --warmup 5 --repeat ${REPEAT:-1} --json $OUT/train_step_cuda.json 2>&1 | grep -v "^\s*$" | tail -14
if [ -n "$BASE" ]; then  # BASE=<another checkout>: its pskv rows, run from its own directory (python -m pskv,
  echo "== train_step, pskv rows of $BASE"  # which starts the servers, takes the package of the working directory)
  (cd "$BASE" && PYTHONPATH=/tmp/site:$BASE timeout 120 python3 "$OLDPWD/benchmarks/train_step.py" --device $DEV --batch $B -n 2 -s 2 --steps $S \
    --warmup 5 --skip plain "pskv local" "pskv 1x1 keys" "pskv 1x1 sum" "pskv 2x2 keys" "ddp x2 (gloo)" "ddp hook 2x2" "torch opt 2x2" --json $OUT/train_step_base.json 2>&1 | grep -v "^\s*$" | tail -6)
fi
}
amp() {
echo "== pskv train --amp, 2 workers x 2 servers, one device each"
for amp in none bf16 fp16; do
  a=$([ $amp = none ] || echo "--amp $amp")
  echo "-- $amp"; timeout 60 python3 -m pskv train --devices $DEV --epochs $E $a --no-progress --report $R/amp_$amp.json 2>&1 | grep -E "^epoch|^done|rror" | tail -4
done
}
devices() {
echo "== devices in one process (local store), batch 64 per device"
for n in 1 2; do
  d=$(python3 -c "print(','.join(['$DEV:0' if '$DEV'=='cuda' else '$DEV']*$n))")
  echo "-- $d"; timeout 45 python3 -m pskv train --kv-store local --devices $d --batch-size $((64*n)) --epochs $E --no-progress --report $R/dev_$n.json 2>&1 | grep -E "^epoch|^done|rror" | tail -4
done
}
timeline() {
echo "== timeline"
timeout 60 python3 benchmarks/timeline_picture.py --device $DEV --batch $B --steps 4 --out $R/timeline_step_cuda.png 2>&1 | tail -2
cp $R/timeline_step_cuda.png $OUT/ 2>/dev/null
}
cluster() {
echo "== emulated cluster, 4 worker hosts + 4 server hosts, 1 Gbit links (ResNet-18 payload, gloo in the same run)"
timeout ${CLUSTER_TIMEOUT:-240} python3 benchmarks/cluster_1gbit.py --rounds ${ROUNDS:-10} --json $OUT/cluster_1gbit.json 2>&1 | tail -20
}
sweep() {  # settings for jobs across hosts, tried on cores that do not starve the hosts (RESULTS.md sections 24, 25: the
# first two were the best at 125 and 250 Mbit on 2 cores, where the CPU per byte is that of 16 cores at 1 Gbit); about 2.5 minutes
echo "== emulated cluster: pskv's settings across hosts, each in the same run as gloo"
timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/cluster_1gbit.py --rounds ${ROUNDS:-8} --json $OUT/cluster_sweep.json \
  --try PSKV_CHUNK_BYTES=524288,PSKV_WINDOW_BYTES=262144 --try PSKV_CHUNK_BYTES=262144,PSKV_WINDOW_BYTES=262144 \
  --try PSKV_WINDOW_BYTES=262144 --try PSKV_CHUNK_BYTES=131072,PSKV_WINDOW_BYTES=131072 --try PSKV_WINDOW_BYTES=8388608 2>&1 | tail -20
}
flat() {  # RESULTS.md section 26: the ResNet-18 payload as one key per parameter and as 4 MB flat keys, from and into GPU tensors
echo "== flat keys on the GPU, 1 x 1 and 2 x 2"
for j in "1 1" "2 2"; do set -- $j; timeout ${FLAT_TIMEOUT:-90} python3 benchmarks/flat_keys.py --device $DEV -n $1 -s $2 --rounds 20 --json $R/flat_keys_$1x$2.json 2>&1 | tail -5; done
}
for part in ${PARTS:-step tests amp devices timeline}; do $part; done
python3 -c "
import json, glob, os
json.dump({os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('$R/*.json'))}, open('$OUT/gpu_runs.json', 'w'), indent=1)"
ls -la $OUT
