#!/usr/bin/env bash
# GPU measurements on the lent H200 (see ../shared/gpu/README.md for the MLX CUDA install; the tree has grown past
# what its two carries allow: scripts/gpu_three_carries.sh splits the wheel into three).
# Usage on the device, after the install:  bash scripts/h200.sh fused|agentloop|turncost|engine|profile|diag|serve|agents|kv|kvfused|kvengine|spec|specreplay|specctl|specloop|skinny|verify|served1|lora|compile
# Results go to $OUT (JSON from bench engine, Parquet + report from bench load). Pass MLXB_GIT_COMMIT=<the local commit>:
# the device's copy of the tree has a stale git history, and the results' git_commit label reads it.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export MLXB_HOME=${MLXB_HOME:-/var/tmp/mlxb-home}
OUT=${OUT:-/tmp/out}
# no pip install on the device: expose commands/ and oracle/ under mlxb/ as setuptools' package-dir would
ln -sfn ../commands mlxb/commands; ln -sfn ../oracle mlxb/oracle
mlxb() { python3 -m mlxb.commands.main "$@"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
mlxb doctor --json > "$OUT/doctor.json"; grep machine_key "$OUT/doctor.json"
case "$1" in
  engine)
    for m in ${MODELS:-synth-llama-1b synth-llama-8b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      mlxb bench engine -m /var/tmp/$m --batches ${BATCHES:-1,8,32,64} --prompt-len 128 --gen 128 --repeats ${REPEATS:-3} --prefill-len 2048 \
        --out "$OUT/engine-$m.json" 2>&1 | tail -32
    done ;;
  profile)
    for m in ${MODELS:-synth-llama-8b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      python3 scripts/profile_decode.py /var/tmp/$m --batches ${BATCHES:-1,8,32,64} --gen 96 --repeats ${REPEATS:-2} \
        --out "$OUT/profile-$m.json" 2>&1 | grep -v Warning
    done ;;
  diag)  # what the padding mask costs a step; the late-joiner stall over three joiners
    for m in ${MODELS:-synth-llama-8b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      python3 scripts/mask_cost.py /var/tmp/$m --batches ${BATCHES:-8,64} 2>&1 | grep -v Warning | tee "$OUT/mask-$m.txt"
      python3 -c "import json,sys; from mlxb.models import load_model; from mlxb.bench.engine import late_joiner_stall as f
m,t,_,_=load_model(sys.argv[1]); json.dump(f(m,t), open(sys.argv[2],'w'), indent=1)" /var/tmp/$m "$OUT/stall-$m.json"
      cat "$OUT/stall-$m.json"
    done ;;
  serve)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || mlxb models build $m --out /var/tmp/$m >/dev/null
    mkdir -p /tmp/bench && cd /tmp/bench
    mlxb bench load -m /var/tmp/$m --peer mlx-lm --batch 64 --concurrency 1 --requests 4 --input-len 400 \
      --output-len 128 --repeats 2 2>&1 | tail -12
    mlxb bench load -m /var/tmp/$m --peer mlx-lm --batch 64 --concurrency 8,32,64 --requests 64 --input-len 400 \
      --output-len 128 --repeats 2 --ttft-threshold 2.0 2>&1 | tail -20
    mlxb report reports/results --out "$OUT/serve-h200.html" && mlxb report reports/results --out "$OUT/serve-h200.md"
    tar czf "$OUT/serve-results.tgz" reports/results ;;
  shapes)  # what a forward at a never-seen shape costs, with and without cuDNN attention graphs
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    for v in 1 0; do echo "MLX_CUDA_USE_CUDNN_SDPA=$v"
      MLX_CUDA_USE_CUDNN_SDPA=$v python3 scripts/shape_cost.py /var/tmp/$m --out "$OUT/shapes-cudnn$v.json" 2>&1 | grep -v Warning
    done ;;
  cohort)  # where a cached cohort's iteration goes (each piece synchronized and timed)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    python3 scripts/cohort_cost.py /var/tmp/$m --rows ${ROWS:-7,13,18,13,18} --out "$OUT/cohort-$m.json" 2>&1 | grep -v Warning ;;
  grammar)  # what llguidance masks cost a decode step (B rows all constrained vs all free)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    MLX_CUDA_USE_CUDNN_SDPA=0 python3 scripts/grammar_cost.py /var/tmp/$m --batches ${BATCHES:-1,8,32} --steps ${STEPS:-48} \
      --out "$OUT/grammar-cost-$m.json" 2>&1 | grep -v Warning ;;
  thread)  # where the engine thread's B=1 step goes (consumer, GIL) vs the runner on the main thread
    for m in ${MODELS:-synth-llama-1b synth-llama-8b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      echo "$m"; python3 scripts/probes/thread_probe.py /var/tmp/$m ${GEN:-128} ${REPEATS:-5} 2>&1 | grep -v Warning | tee "$OUT/thread-$m.txt"
    done ;;
  agents)  # prompt cache: agents sharing a 2k-token system prompt, mlxb serve vs mlx_lm.server, 8 and 32 clients
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    mkdir -p /tmp/bench && cd /tmp/bench
    export MLXB_TRACE="${MLXB_TRACE:-$OUT/trace-agents-PID.jsonl}"; MLXB_TRACE="${MLXB_TRACE/PID/\{pid\}}"  # a file per server
    timeout ${LIMIT:-560} python3 -m mlxb.commands.main bench load -m /var/tmp/$m ${PEER---peer mlx-lm} ${ONE---one-server} --batch 64 \
      --dataset shared-prefix --system-len ${SYSTEM:-2048} --concurrency ${LEVELS:-8,32} --requests ${REQUESTS:-32} \
      --output-len 128 --repeats ${REPEATS:-2} --ttft-threshold 2.0 2>&1 | grep -v Warning | tail -${TAIL:-24}
    for f in $OUT/trace-agents*.jsonl; do [ -s "$f" ] && gzip -f "$f"; done
    mlxb report reports/results --out "$OUT/agents-h200.html" && mlxb report reports/results --out "$OUT/agents-h200.md"
    tar czf "$OUT/agents-results.tgz" reports/results ;;
  kv)  # quantized KV: decode tok/s of KV8/KV4 against full width at long context (our engine; mlx-lm has no batched quantized KV)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    MLX_CUDA_USE_CUDNN_SDPA=0 mlxb bench kv -m /var/tmp/$m --kv-bits 8,4 --batches ${BATCHES:-32} --context ${CONTEXT:-8192} \
      --gen ${GEN:-64} --repeats ${REPEATS:-2} --prefill-chunk ${CHUNK:-8192} --quantized-kv-start ${KV_START:-0} --out "$OUT/kv-$m.json" 2>&1 | grep -v Warning | tail -20
    MLX_CUDA_USE_CUDNN_SDPA=0 python3 scripts/kv_attention_cost.py /var/tmp/$m --context ${CONTEXT:-8192} --batches ${BATCHES:-32} \
      --out "$OUT/kv-attention-$m.json" 2>&1 | grep -v Warning ;;
  kvfused)  # the fused quantized-KV decode kernel: errors vs mlx-lm's path, one layer's time, model steps, engine
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    python3 scripts/kv_fused_check.py --context ${CONTEXT:-8192} --out "$OUT/kv-fused-check.json" 2>&1 | grep -v Warning | tail -${CHECK_TAIL:-6} || exit 1
    [ -n "${CHECK_ONLY:-}" ] && exit 0
    for B in ${BATCHES:-8 32}; do
      python3 scripts/kv_step_cost.py /var/tmp/$m $B ${CONTEXT:-8192} 2>&1 | grep -v Warning | tail -2 | tee "$OUT/kv-step-fused-B$B.txt"
    done
    [ -n "${ENGINE:-}" ] && for mode in fused mlx-lm; do
      MLX_CUDA_USE_CUDNN_SDPA=0 mlxb bench kv -m /var/tmp/$m --kv-bits 8,4 --batches 8,32 --context ${CONTEXT:-8192} --gen 64 \
        --repeats 2 --prefill-chunk 8192 --kv-attention $mode --out "$OUT/kv-engine-$mode.json" 2>&1 | grep -v Warning | tail -12
    done ;;
  kvengine)  # bench kv with the default read (folded where mlx-lm's is wrong) and the fused kernel; output kept as it comes
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    for mode in ${MODES:-mlx-lm fused}; do
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout ${LIMIT:-270} python3 -m mlxb.commands.main bench kv -m /var/tmp/$m --kv-bits 8,4 \
        --batches ${BATCHES:-32} --context ${CONTEXT:-4096} --gen 48 --repeats ${REPEATS:-1} --prefill-chunk 4096 \
        --kv-attention $mode --out "$OUT/kv-engine-$mode.json" > "$OUT/kv-engine-$mode.txt" 2>&1
      echo "$mode rc=$?"; grep -v Warning "$OUT/kv-engine-$mode.txt" | tail -12
    done ;;
  specctl)  # the speculation controller as shipped: lookup K=4 on synth-llama-8b, repetitive and random prompts, B=1 and 8
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    MLX_CUDA_USE_CUDNN_SDPA=0 mlxb bench spec -m /var/tmp/$m --spec lookup --batches ${BATCHES:-1,8} --context 512 --gen ${GEN:-128} \
      --repeats ${REPEATS:-3} --out "$OUT/bench-spec-ctl.json" 2>&1 | grep -v Warning | tail -14 ;;
  specloop)  # issue 15: lookup on looping output (the prompt ends in the model's own greedy loop) and random prompts, B=1 and 8;
             # then a random synth-llama-1b draft for synth-llama-8b (acceptance about 0); then the controller's trace at random B=8
    for m in synth-llama-8b $([ "${DRAFT:-1}" = 1 ] && echo synth-llama-1b); do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    done
    export MLX_CUDA_USE_CUDNN_SDPA=0
    timeout ${LIMIT1:-300} python3 -m mlxb.commands.main bench spec -m /var/tmp/synth-llama-8b --spec lookup --regimes ${REGIMES:-looping,random} --batches ${BATCHES:-1,8} \
      --spec-max-batch 8 --context ${CONTEXT:-512} --gen ${GEN:-128} --repeats ${REPEATS:-3} --out "$OUT/bench-spec-loop.json" 2>&1 | grep -v Warning | tail -14
    [ "${DRAFT:-1}" = 1 ] && timeout ${LIMIT2:-150} python3 -m mlxb.commands.main bench spec -m /var/tmp/synth-llama-8b --draft-model /var/tmp/synth-llama-1b --regimes random \
      --batches ${BATCHES:-1,8} --spec-max-batch 8 --context ${CONTEXT:-512} --gen ${GEN:-128} --repeats 2 --out "$OUT/bench-spec-draft1b.json" 2>&1 | grep -v Warning | tail -10
    [ "${TRACE:-1}" = 1 ] && timeout ${LIMIT3:-90} python3 scripts/spec_trace.py /var/tmp/synth-llama-8b random:8 2 128 2>&1 | grep -v Warning | tee "$OUT/trace-random-b8.txt" | cut -c1-1500 ;;
  skinny)  # the skinny matmul (--skinny-matmul): per-projection cost and exactness against MLX's matmul, then bench engine
           # with skinny arms at B>1; PART=2: bench spec (lookup; looping and random) with both engines on it
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    export MLX_CUDA_USE_CUDNN_SDPA=0
    if [ "${PART:-1}" = 1 ]; then
      timeout ${LIMIT1:-200} python3 scripts/skinny_cost.py --out "$OUT/skinny-cost.json" --repeats 3 2>&1 | grep -v Warning | cut -c1-400
      timeout ${LIMIT2:-280} python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches ${BATCHES:-1,8,16} --prompt-len 128 --gen 128 \
        --repeats ${REPEATS:-3} --prefill-len 512 --skinny-matmul --out "$OUT/engine-skinny.json" 2>&1 | grep -v Warning | tail -24
    else
      timeout ${LIMIT3:-560} python3 -m mlxb.commands.main bench spec -m /var/tmp/$m --spec lookup --regimes ${REGIMES:-looping,random} \
        --batches ${BATCHES:-1,8} --spec-max-batch 8 --context ${CONTEXT:-512} --gen 128 --repeats ${REPEATS:-2} --skinny-matmul \
        --out "$OUT/bench-spec-skinny.json" 2>&1 | grep -v Warning | tail -14
    fi ;;
  verify)  # a lone row's verify forward: MLX's attention, split causal (mlxb.kernels.causal_split), + skinny; then
           # PART=2: bench spec lookup (looping, random; B=1 and 8; the split installs itself on CUDA)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    export MLX_CUDA_USE_CUDNN_SDPA=0
    if [ "${PART:-1}" = 1 ]; then
      timeout ${LIMIT1:-200} python3 scripts/verify_cost.py /var/tmp/$m --out "$OUT/verify-cost.json" --context ${CONTEXT:-512} 2>&1 | grep -v Warning
    fi
    if [ "${PART:-1}" = 2 ] || [ "${BOTH:-0}" = 1 ]; then
      timeout ${LIMIT3:-400} python3 -m mlxb.commands.main bench spec -m /var/tmp/$m --spec lookup --regimes ${REGIMES:-looping,random} \
        --batches ${BATCHES:-1,8} --spec-max-batch 8 --context ${CONTEXT:-512} --gen 128 --repeats ${REPEATS:-2} ${EXTRA:-} \
        --out "$OUT/bench-spec-split.json" 2>&1 | grep -v Warning | tail -14
    fi ;;
  pipeline)  # issue 15: bench spec with a lone row's verify steps pipelined (--spec-pipeline) against not, same machine
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    export MLX_CUDA_USE_CUDNN_SDPA=0
    for ctx in ${CONTEXTS:-512}; do
      for mode in ${MODES:-auto off}; do
        echo "== context $ctx --spec-pipeline $mode"
        timeout ${LIMIT:-280} python3 -m mlxb.commands.main bench spec -m /var/tmp/$m --spec lookup --regimes ${REGIMES:-looping,random} \
          --batches ${BATCHES:-1} --spec-max-batch 8 --context $ctx --gen ${GEN:-128} --repeats ${REPEATS:-3} --spec-pipeline $mode ${EXTRA:-} \
          --out "$OUT/bench-spec-pipeline-$mode-$ctx${TAG:-}.json" 2>&1 | grep -v Warning | tail -9
      done
    done ;;
  vprobe)  # issue 15: chained unread steps, one-token and verify width: build / async_eval / read per step
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    export MLX_CUDA_USE_CUDNN_SDPA=0
    timeout ${LIMIT:-240} python3 scripts/probes/verify_pipeline_probe.py /var/tmp/$m --out "$OUT/verify-pipeline-probe.json" \
      --context ${CONTEXT:-512} ${PROBE_ARGS:-} 2>&1 | grep -v Warning ;;
  fuse)  # q/k/v and gate/up fused (--fuse-projections): the chained-step probe, then bench engine with fused arms
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    export MLX_CUDA_USE_CUDNN_SDPA=0
    [ "${PROBE:-1}" = 1 ] && timeout ${LIMIT1:-150} python3 scripts/probes/verify_pipeline_probe.py /var/tmp/$m --out "$OUT/verify-pipeline-probe-fused.json" \
      --context 512 --steps ${STEPS:-30} 2>&1 | grep -v Warning
    timeout ${LIMIT2:-330} python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches ${BATCHES:-1,8,32} --prompt-len 128 \
      --gen ${GEN:-64} --repeats ${REPEATS:-3} --prefill-len 512 --fuse-projections --out "$OUT/engine-fused.json" 2>&1 \
      | grep -v Warning | grep -E "fused|aggregate|decode" | head -12 ;;
  compile)  # issue 19: the whole B=1 step under mx.compile (masked whole-buffer read) against the plain step
    for m in ${MODELS:-synth-llama-1b synth-llama-8b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      timeout ${LIMIT:-200} python3 scripts/probes/compile_step_probe.py /var/tmp/$m --gen ${GEN:-128} --repeats ${REPEATS:-3} ${PROBE_ARGS:-} 2>&1 \
        | grep -v Warning | tee "$OUT/compile-step-$m.txt"
    done ;;
  graphs)  # issue 19: bench engine at two MLX CUDA graph sizes (MLX_MAX_OPS_PER_BUFFER; MLX's default is 20), then a served
           # lone stream (needs the server wheels carried: see scripts/gpu_three_carries.sh)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    for s in ${GRAPH_SETTINGS:-20 250}; do
      MLX_MAX_OPS_PER_BUFFER=$s timeout ${LIMIT:-170} python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches ${BATCHES:-1,8,32} \
        --prompt-len 128 --gen ${GEN:-96} --repeats ${REPEATS:-3} --prefill-len 512 --out "$OUT/engine-graphs-$s.json" 2>&1 \
        | grep -v Warning | tee "$OUT/engine-graphs-$s.txt" | grep -E "decode|aggregate|prefill" | head -8
    done
    mkdir -p /tmp/bench && cd /tmp/bench
    timeout ${SERVE_LIMIT:-120} python3 -m mlxb.commands.main bench load -m /var/tmp/$m --batch 8 --concurrency 1 --requests 6 \
      --input-len 100 --output-len 128 --repeats 2 2>&1 | tee "$OUT/served1.txt" | tail -8 ;;
  lone)  # issue 19: the idle clear's cost to a lone request's last token (probe), then bench engine B=1 and a served lone stream
    for m in ${MODELS:-synth-llama-8b synth-llama-1b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      timeout ${LIMIT1:-120} python3 scripts/probes/idle_clear_probe.py /var/tmp/$m --gen 128 --repeats ${REPEATS:-5} --out "$OUT/idle-clear-$m.json" \
        2>&1 | grep -v Warning | grep -v '^{"repeat"' | tr -d ' \n'; echo
      timeout ${LIMIT2:-200} python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches 1 --prompt-len 128 --gen 128 \
        --repeats ${REPEATS:-5} --prefill-len 512 --out "$OUT/engine-b1-$m.json" 2>&1 | grep -v Warning | grep -E "b1|aggregate|prefill" | head -8
      [ "${SERVED:-1}" = 1 ] || continue
      mkdir -p /tmp/bench && (cd /tmp/bench && timeout ${LIMIT3:-150} python3 -m mlxb.commands.main bench load -m /var/tmp/$m --batch 8 \
        --concurrency 1 --requests 6 --input-len 100 --output-len 128 --repeats 3 2>&1 | tail -8)
    done
    [ -d /tmp/bench/reports ] && (cd /tmp/bench && tar czf "$OUT/lone-served-results.tgz" reports/results) ;;
  gemv)  # issue 19: the skinny kernel with its loads unrolled (MLXB_SKINNY_UNROLL) at 1..8 rows against MLX's gemv and
         # cuBLAS (bandwidth, bit-equality), then bench engine B=1 (and B=8) with lone rows on it
    python3 scripts/skinny_cost.py --out "$OUT/gemv-cost.json" --rows ${ROWS:-1,2,5,8} --rw ${RW:-1,2} --unroll ${UNROLLS:-1,2,4,8} \
      --reductions cg --shapes ${SHAPES:-8b-qo,8b-kv,8b-gateup,8b-down,1b-qo,1b-gateup} --repeats 3 2>&1 | grep -v Warning | grep -v '^{' 
    python3 -c "
import json; d=json.load(open('$OUT/gemv-cost.json'))
for r in d['results']:
    arms={k[:-3]: r[k] for k in r if k.endswith('_us') and not k.endswith('build_us')}
    best=min(arms, key=arms.get)
    eq={k: r.get(k+'_rows_equal_gemv') for k in arms if k!='mlx'}
    print(r['shape'], r['rows'], 'mlx %.1fus %.0fGB/s' % (r['mlx_us'], r['mlx_gbps']), 'best', best, '%.1fus' % arms[best],
          ' '.join('%s=%.1f' % (k, v) for k, v in sorted(arms.items()) if k != 'mlx'), 'all rows equal:', all(v == r['rows'] for v in eq.values()))
"
    [ "${BENCH:-1}" = 1 ] || exit 0
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    MLXB_SKINNY_MIN_ROWS=1 MLXB_SKINNY_MAX_WEIGHT=${MAXW:-100000000000} MLXB_SKINNY_UNROLL=${U:-4} timeout ${LIMIT:-300} \
      python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches ${BATCHES:-1,8} --prompt-len 128 --gen 128 \
      --repeats ${REPEATS:-5} --prefill-len 512 --skinny-matmul --out "$OUT/engine-gemv-u${U:-4}.json" 2>&1 | grep -v Warning \
      | grep -E "b1|skinny|aggregate|prefill" ;;
  servedb1)  # issue 19: bench engine B=1 with --served (the same prompt through mlxb serve, bracketing the in-process arms)
    for m in ${MODELS:-synth-llama-8b synth-llama-1b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      timeout ${LIMIT:-240} python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches ${BATCHES:-1} --prompt-len 128 \
        --gen ${GEN:-128} --repeats ${REPEATS:-5} --prefill-len 512 --served --out "$OUT/engine-served-$m.json" 2>&1 \
        | grep -v Warning | grep -E "b1|served|request|aggregate|prefill" | head -12
    done ;;
  served1)  # a lone request served by mlxb serve against our in-process B=1 and mlx-lm (issue 19), then CUDA LoRA parity
    for m in ${MODELS:-synth-llama-8b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      mlxb bench engine -m /var/tmp/$m --batches 1 --prompt-len 128 --gen 128 --repeats ${REPEATS:-5} --prefill-len 512 \
        --out "$OUT/engine-b1-$m.json" 2>&1 | tail -8
      mkdir -p /tmp/bench && cd /tmp/bench
      mlxb bench load -m /var/tmp/$m --batch 8 --concurrency 1 --requests 6 --input-len 100 --output-len 128 --repeats 3 2>&1 | tail -8
      cd - >/dev/null
    done
    (cd /tmp/bench && tar czf "$OUT/served1-results.tgz" reports/results)
    [ "${LORA:-1}" = 1 ] || exit 0  # LORA=0: the served measurement only
    # progress lines reach parity-lora.err as each preset runs, so a cut-short run still says how far it got
    timeout ${LIMIT:-300} python3 -m mlxb.commands.main parity --all --case lora --against live --json \
      > "$OUT/parity-lora-live.json" 2> "$OUT/parity-lora.err"; echo "parity rc=$?"; tail -3 "$OUT/parity-lora.err"
    python3 -c "import json; d=json.load(open('$OUT/parity-lora-live.json')); r=d['results']
print('lora parity', d['ok'], len(r), sum(x['exact'] for x in r), [x['case']+' '+x['against'] for x in r if not x['ok']])" ;;
  lora)  # per-row LoRA on CUDA: one decode forward per path (stacked / fused / concat), then bench lora per path;
    # CATK="0 auto": the concat path without and with its one-launch expand (MLXB_LORA_CAT_KERNEL), files suffixed -k0/-kauto;
    # PARITY=1 first runs the lora parity case on tiny-llama per CATK value (concat forced)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    for k in ${CATK:-auto}; do
      sfx=${CATK:+-k$k}; export MLXB_LORA_CAT_KERNEL=$k
      [ "${PARITY:-0}" = 1 ] && { MLXB_LORA_PATH=concat timeout 120 python3 -m mlxb.commands.main parity -m tiny-llama --case lora \
        --against live --b 2,4 --json > "$OUT/parity-lora-concat$sfx.json" 2>/dev/null; echo "parity k=$k rc=$?"
        python3 -c "import json; d=json.load(open('$OUT/parity-lora-concat$sfx.json')); r=d['results']
print('lora parity', d['ok'], len(r), sum(x['exact'] for x in r))"; }
      for p in ${PATHS-stacked fused}; do
        MLXB_LORA_PATH=$p timeout 150 python3 scripts/lora_cost.py /var/tmp/$m ${B:-8} 16 2>&1 | grep -v Warning > "$OUT/lora-cost-$p$sfx.txt"
        echo "$p$sfx rc=$?"; cat "$OUT/lora-cost-$p$sfx.txt"
      done
      for p in ${BENCH_PATHS-stacked fused}; do
        timeout ${LIMIT:-200} python3 -m mlxb.commands.main bench lora -m /var/tmp/$m --adapters 4 --rank 16 --batches ${BATCHES:-8,32} \
          --gen ${GEN:-48} --repeats ${REPEATS:-2} --lora-path $p --out "$OUT/bench-lora-$p$sfx.json" > "$OUT/bench-lora-$p$sfx.txt" 2>&1
        echo "bench lora $p$sfx rc=$?"; grep -v Warning "$OUT/bench-lora-$p$sfx.txt" | tail -12
      done
    done ;;
  goldens)  # CUDA goldens: every tiny preset x case x B=1..4, fp32 and bf16 (resumable: existing files are kept)
    key=$(python3 -c 'from mlxb.doctor import machine_key; print(machine_key())')
    t0=$(date +%s); timeout ${LIMIT:-540} python3 -m mlxb.commands.main golden-gen --all 2>&1 | tail -4
    echo "golden-gen $(( $(date +%s) - t0 ))s"; tar czf "$OUT/goldens-$key.tgz" goldens/$key ;;
  parity)  # the whole parity matrix against the live oracle and the goldens, then clean stops under load
    t0=$(date +%s); timeout ${LIMIT:-420} python3 -m mlxb.commands.main parity --all --against both --json > "$OUT/parity-all.json"
    echo "parity rc=$? in $(( $(date +%s) - t0 ))s"
    python3 -c "import json,collections; d=json.load(open('$OUT/parity-all.json')); c=collections.Counter()
for x in d['results']:
    k=x['against'].split(':')[0]; c[k,'cases']+=1; c[k,'ok']+=x['ok']
    for f in ('steps','exact','envelope','tokens_only'): c[k,f]+=x[f]
print(d['ok'], d['machine_key'], dict(c)); print([x['case']+' '+x['against'] for x in d['results'] if not x['ok']][:20])"
    python3 -m pytest -q -p no:cacheprovider tests/server/test_serve_cli.py -k "busy or generate" 2>&1 | tail -3 ;;
  specparity)  # the spec parity case on CUDA: goldens for every preset it applies to, then live + golden comparison
    key=$(python3 -c 'from mlxb.doctor import machine_key; print(machine_key())')
    python3 -m mlxb.commands.main golden-gen --all --case spec 2>&1 | tail -3
    python3 -m mlxb.commands.main parity --all --case spec --against both --json > "$OUT/parity-spec.json"
    echo "parity rc=$?"
    python3 -c "import json; d=json.load(open('$OUT/parity-spec.json')); r=d['results']
print(d['ok'], d['machine_key'], len(r), sum(x['steps'] for x in r), sum(x['exact'] for x in r), [x['case']+' '+x['against'] for x in r if not x['ok']])"
    python3 -m mlxb.commands.main parity -m tiny-llama --b 3 --case spec --against live --plant-fault spec_rollback_off_by_one | tail -2
    tar czf "$OUT/goldens-spec-$key.tgz" goldens/$key/*/spec-* ;;
  spec)  # speculative decoding vs plain on our engine: synth-llama-1b drafting for synth-llama-8b, self-draft, lookup
    for m in synth-llama-1b synth-llama-8b; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    done
    m=/var/tmp/synth-llama-8b
    for d in /var/tmp/synth-llama-1b $m; do
      MLX_CUDA_USE_CUDNN_SDPA=0 mlxb bench spec -m $m --draft-model $d --batches ${BATCHES:-1,8} --regimes random \
        --context ${CONTEXT:-512} --gen ${GEN:-96} --repeats ${REPEATS:-2} --out "$OUT/spec-draft-$(basename $d).json" 2>&1 | grep -v Warning | tail -12
    done
    MLX_CUDA_USE_CUDNN_SDPA=0 mlxb bench spec -m $m --spec lookup --batches ${BATCHES:-1,8} --context ${CONTEXT:-512} \
      --gen ${GEN:-96} --repeats ${REPEATS:-2} --out "$OUT/spec-lookup.json" 2>&1 | grep -v Warning | tail -14 ;;
  specreplay)  # issue 15: the mechanism at a chosen acceptance (bench spec's replay regime), lookup settings, K=4;
    # MISS="0.1 0.3": one run per miss rate; EXTRA: more bench spec flags (e.g. --spec-fixed, --fuse-projections)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    for q in ${MISS:-0.1}; do
      timeout ${LIMIT:-280} python3 -m mlxb.commands.main bench spec -m /var/tmp/$m --regimes replay --replay-miss $q \
        --batches ${BATCHES:-1,8} --context ${CONTEXT:-512} --gen ${GEN:-96} --repeats ${REPEATS:-3} ${EXTRA:-} \
        --out "$OUT/spec-replay-miss$q.json" 2>&1 | grep -v "Warning\|benchmarking:" | tail -12
    done ;;
  stop)  # mlxb serve on the 8B shape stopped with SIGINT right after a served benchmark, 3 times: exit code, last lines
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    mkdir -p /tmp/bench && cd /tmp/bench
    for i in 1 2 3; do
      python3 -m mlxb.commands.main serve -m /var/tmp/$m --batch 32 --port 8400 > "$OUT/stop-$i.log" 2>&1 & pid=$!
      for k in $(seq 240); do curl -sf localhost:8400/health >/dev/null && break; sleep 1; done
      mlxb bench load --base-url http://127.0.0.1:8400/v1 -m /var/tmp/$m --concurrency 8 --requests 16 --input-len 200 \
        --output-len 64 > "$OUT/stop-load-$i.txt" 2>&1
      kill -INT $pid; wait $pid; echo "run $i: serve exit $?; $(grep -c -i 'segmentation\|terminate called\|abort' "$OUT/stop-$i.log") crash lines"
      tail -2 "$OUT/stop-$i.log"
    done
    cd - >/dev/null
    python3 -c "import mlx.core as mx; from mlxb.cache.protocol import mask_free_is_exact as f
for h, d in ((128, mx.bfloat16), (128, mx.float32), (64, mx.bfloat16)): print('mask-free exact', h, d, f(mx.zeros((8, 8, 64, h), dtype=d)))"
    python3 scripts/mask_cost.py /var/tmp/$m --batches ${BATCHES:-8,32,64} 2>&1 | grep -v Warning | tee "$OUT/mask-cost-$m.txt" ;;
  tpnccl)  # nvidia-h200-x2: one all_sum's latency (alone, 64 chained in one graph) under NCCL protocol/algorithm settings
    L="python3 /tmp/site/bin/mlx.launch --backend nccl -n 2 --"
    for v in "" "NCCL_PROTO=LL" "NCCL_PROTO=LL128" "NCCL_PROTO=Simple" "NCCL_ALGO=Ring NCCL_PROTO=LL" "NCCL_MAX_NCHANNELS=1 NCCL_PROTO=LL"; do
      echo "env: ${v:-default}"; env $v NCCL_NVLS_ENABLE=0 timeout 60 $L python3 scripts/tp_diag.py x --collectives-only 2>&1 | grep -v "NCCL INFO\|Warning" | tail -2
    done ;;
  tp)  # nvidia-h200-x2: tensor parallel over NCCL. TP=2 vs one GPU (our engine both sides, one run), then served 32 clients
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    L="python3 /tmp/site/bin/mlx.launch --backend nccl -n 2 --"
    if [ "${PART:-bench}" = bench ]; then
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout ${LIMIT:-400} $L python3 -m mlxb.commands.main bench tp -m /var/tmp/$m --tp 2 --batches ${BATCHES:-1,32,64} \
        --prompt-len 128 --gen 128 --repeats ${REPEATS:-3} --prefill-len 2048 --out "$OUT/tp2-$m.json" 2>&1 | grep -v "NCCL INFO\|Warning" | tail -24
    else  # served: the same 32-client load on --tp 2 and on one GPU
      mkdir -p /tmp/bench && cd /tmp/bench
      for tp in 2 1; do
        if [ $tp = 2 ]; then $L python3 -m mlxb.commands.main serve -m /var/tmp/$m --tp 2 --batch 64 --port 8400 > "$OUT/serve-tp2.log" 2>&1 &
        else python3 -m mlxb.commands.main serve -m /var/tmp/$m --batch 64 --port 8400 > "$OUT/serve-tp1.log" 2>&1 & fi
        for i in $(seq 240); do curl -sf localhost:8400/health >/dev/null && break; sleep 1; done
        mlxb bench load --base-url http://127.0.0.1:8400/v1 -m /var/tmp/$m --stack mlxb-tp$tp --concurrency ${LEVELS:-32} \
          --requests ${REQUESTS:-64} --input-len 400 --output-len 128 --repeats ${REPEATS:-2} 2>&1 | tail -8
        curl -s localhost:8400/stats > "$OUT/stats-tp$tp.json"
        pkill -TERM -f "serve -m /var/tmp/$m --tp 2" ; pkill -TERM -f "serve -m /var/tmp/$m --batch 64"; sleep 8
      done
      tar czf "$OUT/tp-serve-results.tgz" reports/results
    fi ;;
  graphcache)  # MLX's CUDA graph-cache thrashing fuse: does it exist, does a served workload reach it, does mlxb's setting stop it
    echo "libmlx strings: $(grep -c 'Cache thrashing' /tmp/site/mlx/lib/libmlx.so 2>/dev/null) match(es)"
    python3 scripts/graph_cache_probe.py --out "$OUT/graph-cache-probe.json" 2>&1 | grep -v Warning
    m=${MODEL:-synth-llama-1b}
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    for v in 1 mlxb; do
      echo "check=$v cache=${CAP:-100}"
      if [ $v = 1 ]; then export MLX_ENABLE_CACHE_THRASHING_CHECK=1; else unset MLX_ENABLE_CACHE_THRASHING_CHECK; fi
      MLX_CUDA_GRAPH_CACHE_SIZE=${CAP:-100} timeout ${LIMIT:-200} python3 scripts/graph_cache_stress.py 8410 ${REQ:-96} \
        --model /var/tmp/$m --spec lookup --spec-max-batch 8 2>&1 | grep -v Warning | tee "$OUT/graph-cache-stress-check$v.txt"
    done ;;
  graphmix)  # mixed step shapes against each shape alone, at MLX's graph-cache size and a larger one (separate processes, alternating)
    for m in ${MODELS:-synth-llama-8b}; do
      [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
      for pass in 1 2; do for c in 400 4000; do
        MLX_CUDA_GRAPH_CACHE_SIZE=$c python3 scripts/probes/graph_mix_probe.py /var/tmp/$m --repeats ${REPEATS:-20} \
          --out "$OUT/graph-mix-$m-cache$c-pass$pass.json" 2>&1 | grep -v Warning
      done; done
    done ;;
  loraserved)  # issue 16: four rank-16 adapters mixed across requests, mlxb serve vs mlx_lm.server (which reloads), 8 clients;
    # then mlxb alone: the same load with and without the adapters (served mixed / base)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    mkdir -p /tmp/bench && cd /tmp/bench && ln -sfn "$OLDPWD/matrices" matrices
    # PEER=0: mlxb alone only (MLXB_LORA_PATH, exported, reaches the servers it starts)
    [ "${PEER:-1}" = 0 ] || { t0=$(date +%s); timeout ${LIMIT:-400} python3 -m mlxb.commands.main bench features \
      --matrix matrices/lora-h200.toml --cell lora16 -m /var/tmp/$m --peer mlx-lm --batch 32 2>&1 | grep -v Warning | tail -10
      echo "features rc=$? in $(( $(date +%s) - t0 ))s"; }
    timeout ${LIMIT2:-150} python3 -m mlxb.commands.main bench features --matrix matrices/lora-h200.toml --repeats ${REPEATS:-3} \
      -m /var/tmp/$m --batch 32 2>&1 | grep -v Warning | tail -10
    tar czf "$OUT/lora-served-results.tgz" reports/results ;;
  speccheap)  # issue 15: bench spec with the draft length kept at the longest where a verify step is cheap
    # (MLXB_SPEC_CHEAP_VERIFY=1.5) against the shrink (0, the default), separate processes, alternating
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    export MLX_CUDA_USE_CUDNN_SDPA=0
    for pass in ${PASSES:-1 2}; do for v in 0 1.5; do
      echo "== pass $pass MLXB_SPEC_CHEAP_VERIFY=$v"
      MLXB_SPEC_CHEAP_VERIFY=$v timeout ${LIMIT:-250} python3 -m mlxb.commands.main bench spec -m /var/tmp/$m --spec lookup \
        --regimes ${REGIMES:-looping,random} --batches ${BATCHES:-8} --spec-max-batch 8 --context 512 --gen ${GEN:-96} \
        --repeats ${REPEATS:-2} --out "$OUT/bench-spec-cheap$v-pass$pass.json" 2>&1 | grep -v Warning | tail -6
    done; done ;;
  shared)  # issue 47: shared-prefix KV on the 8B: decode step and KV bytes at B=32 over a 6k-token prefix (copies vs
           # shared, fresh prompts per repeat), then peak rows under one --kv-budget (BUDGET_ROWS whole rows)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    timeout ${LIMIT:-480} python3 -m mlxb.commands.main bench shared -m /var/tmp/$m --rows ${ROWS:-32} --prefix ${PREFIX:-6144} \
      --own ${OWN:-64} --gen ${GEN:-32} --plain-rows ${PLAIN:-8} --repeats ${REPEATS:-3} --budget-rows ${BUDGET_ROWS:-4} \
      --cells ${CELLS:-fleet,unshared,b1} $([ "${F32:-0}" = 1 ] && echo --f32-arm) --out "$OUT/shared" 2>&1 | grep -v Warning | tail -${TAIL:-40} ;;
  fused)  # --kv-attention fused on full-precision KV (mlxb/kernels/dense_attention.py): one layer's masked read, MLX
          # against the kernel and the cascade against it; PART=2: bench engine with and without (ours vs mlx-lm's
          # BatchGenerator each); PART=3: the 32-agent loop, fused against off (MLXB_KV_ATTENTION=fused, --peer mlxb-fused-off)
    m=synth-llama-8b
    [ "${PART:-1}" = 1 ] || [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    case ${PART:-1} in
      1) timeout ${LIMIT:-240} python3 scripts/dense_attention_cost.py --batches ${BATCHES:-8,32,64} --context ${CONTEXT:-2048,8192} \
           --out "$OUT/dense-attention-cost.json" 2>&1 | grep -v Warning ;;
      2) for mode in ${MODES:-fused mlx-lm}; do echo "== --kv-attention $mode"
           timeout ${LIMIT:-270} python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches ${BATCHES:-8,32,64} \
             --prompt-len ${PROMPT:-1024} --gen 128 --repeats ${REPEATS:-2} --prefill-len 512 --kv-attention $mode \
             --out "$OUT/engine-kv-$mode.json" 2>&1 | grep -v Warning | tail -${TAIL:-16}
         done ;;
      3) MLXB_KV_ATTENTION=fused PEER="--peer ${FUSED_PEER:-mlxb-fused-off}" LEVELS=${LEVELS:-32} REPEATS=${REPEATS:-2} \
           bash "$0" agentloop ;;
    esac ;;
  variants)  # issue 46: the fused attention kernel's variants (scripts/fused_variants_check.py: bf16 after the f32 self-check,
             # one compile per query count, the warm-up's time fresh and from MLX's disk cache), then the 32-agent loop against
             # mlx_lm.server with the kernels MLX compiled during it listed (jit-during-run.txt: what a warm-up still misses)
    python3 scripts/fused_variants_check.py --out "$OUT/variants-first.json" 2>&1 | grep -v Warning | tail -${TAIL:-12}
    python3 scripts/fused_variants_check.py --out "$OUT/variants-again.json" 2>&1 | grep -v Warning | tail -1
    [ "${LOOP:-1}" = 1 ] || exit 0
    touch /tmp/jit-marker; t0=$(date +%s)
    LEVELS=${LEVELS:-32} REPEATS=${REPEATS:-2} TAIL=${LOOP_TAIL:-16} TRACE_TAIL=${TRACE_TAIL:-40} bash "$0" agentloop
    { echo "loop started $t0"; find /tmp/mlx -name '*.ptx' -newer /tmp/jit-marker -printf '%T@ %f\n' 2>/dev/null | sort; } > "$OUT/jit-during-run.txt"
    wc -l "$OUT/jit-during-run.txt" ;;
  agentloop)  # issue 46: C agents x K turns with tools, mlxb serve vs mlx_lm.server, fresh text per run, mlxb's trace
              # (MLXB_TRACE_SYNC=1: the cohort pieces in the trace attribute device time; the ratios then run a little slow)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    here=$PWD; mkdir -p /tmp/bench && cd /tmp/bench
    export MLXB_TRACE="${MLXB_TRACE:-$OUT/trace-agentloop-PID.jsonl}"; MLXB_TRACE="${MLXB_TRACE/PID/\{pid\}}"  # a file per server
    timeout ${LIMIT:-480} python3 -m mlxb.commands.main bench load -m /var/tmp/$m ${PEER---peer mlx-lm} ${ONE---one-server} --batch ${BATCH:-64} \
      --dataset agent-loop --system-len ${SYSTEM:-1500} --input-len ${TASK:-100} --tool-len ${TOOL:-80} --turns ${TURNS:-4} \
      --concurrency ${LEVELS:-16,32} --output-len ${GEN:-128} --repeats ${REPEATS:-2} 2>&1 | grep -v Warning | tail -${TAIL:-30}
    for f in $OUT/trace-agentloop*.jsonl; do
      [ -s "$f" ] || continue; echo "== $f"; s=${f%.jsonl}; s=${s/trace-/trace-summary-}
      python3 "$here/scripts/trace_summary.py" "$f" --json "$s.json" 2>&1 | grep -E "^(${TRACE_KEYS:-decode_only_ms|with_prefill_ms|queue_wait|prefill_ms|cohort_size|arrival_gap|made_to|recv|prep_to|mem_moved|slow_cohorts})"
      gzip -f "$f"
    done
    python3 -m mlxb.commands.main report reports/results --out "$OUT/agentloop-h200.md" >/dev/null
    tar czf "$OUT/agentloop-results.tgz" reports/results ;;
  turncost)  # issue 46: where an agent loop's turn boundary goes (scripts/cohort_cost.py --mode turn), copies vs shared
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    args="--mode turn --rows ${ROWS:-16,32,16,32} --system ${SYSTEM:-1500} --history ${HISTORY:-400} --own ${OWN:-113} --running ${RUNNING:-16}"
    python3 scripts/cohort_cost.py /var/tmp/$m $args --out "$OUT/turn-copies.json" 2>&1 | grep -v Warning
    MLXB_SHARE_MIN_SAVED=0 python3 scripts/cohort_cost.py /var/tmp/$m $args --share-min 256 --out "$OUT/turn-shared.json" 2>&1 | grep -v Warning ;;
  engineburst)  # issue 46: B=64 with 1k-token prompts, our prefill budget at serve's default and larger (stop 64: all 64 first
                # tokens 3.8 s against mlx-lm's 2.1 s, which prefills every prompt in one batch)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    for step in ${STEPS:-2048 8192}; do echo "== --prefill-step-size $step"
      timeout ${LIMIT:-200} python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches ${BATCHES:-64} \
        --prompt-len ${PROMPT:-1024} --gen 128 --repeats ${REPEATS:-2} --prefill-step-size $step \
        --out "$OUT/engine-step$step.json" 2>&1 | grep -v Warning | tail -${TAIL:-12}
    done ;;
  engine6k)  # issue 46: 32 rows of ~6k-token prompts in process; mlx-lm's BatchGenerator may run out of memory (recorded as failed)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    timeout ${LIMIT:-300} python3 -m mlxb.commands.main bench engine -m /var/tmp/$m --batches ${BATCHES:-32} --prompt-len ${PROMPT:-6000} \
      --gen ${GEN:-64} --repeats ${REPEATS:-1} --prefill-len 2048 --out "$OUT/engine-6k-$m.json" 2>&1 | grep -v Warning | tail -${TAIL:-16} ;;
  forcedtools)  # issue 48: every 2nd request carries tools, auto (control) then forced; TPOT of the rows without tools, 8 and 32 clients
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    here=$PWD; mkdir -p /tmp/bench && cd /tmp/bench
    export MLXB_TRACE="$OUT/trace-forced-PID.jsonl"; MLXB_TRACE="${MLXB_TRACE/PID/\{pid\}}"  # decode steps with/without grammar rows
    timeout ${LIMIT:-300} python3 -m mlxb.commands.main bench load -m /var/tmp/$m --batch 32 --dataset random --forced-tools ${EVERY:-2} \
      --concurrency ${LEVELS:-8,32} --requests ${REQUESTS:-48} --input-len 256 --output-len ${GEN:-96} --repeats ${REPEATS:-3} \
      2>&1 | grep -v Warning | tail -${TAIL:-24}
    for f in $OUT/trace-forced*.jsonl; do
      [ -s "$f" ] || continue; echo "== $f"; python3 "$here/scripts/trace_summary.py" "$f" --json "${f%.jsonl}-summary.json" 2>&1 | tail -40; gzip -f "$f"
    done
    tar czf "$OUT/forcedtools-results.tgz" reports/results ;;
  forcedspy)  # issue 48: forcedtools with py-spy (carry .whl/g: the py-spy wheel) on the server once grammar rows run:
              # who holds the GIL (--gil) and every thread's stack (--idle), 12 s each, raw collapsed stacks
    w=$(ls $PWD/.whl/g/py_spy-*.whl | head -1); mkdir -p /tmp/pyspy && (cd /tmp/pyspy && python3 -m zipfile -e "$w" .)
    spy=$(ls /tmp/pyspy/py_spy-*/scripts/py-spy); chmod +x "$spy"
    (
      for i in $(seq 900); do f=$(grep -l '"grammar": [1-9]' $OUT/trace-forced-*.jsonl 2>/dev/null | head -1); [ -n "$f" ] && break; sleep 0.3; done
      pid=${f##*-}; pid=${pid%.jsonl}; echo "py-spy on $pid"
      "$spy" record --pid $pid --duration 12 --rate 200 --gil --nonblocking --format raw -o $OUT/pyspy-gil.txt >/dev/null 2>&1
      "$spy" record --pid $pid --duration 12 --rate 200 --idle --threads --nonblocking --format raw -o $OUT/pyspy-all.txt >/dev/null 2>&1
      "$spy" dump --pid $pid > $OUT/pyspy-dump.txt 2>&1
    ) &
    LEVELS=${LEVELS:-8,32} REPEATS=${REPEATS:-2} bash "$0" forcedtools
    wait; ls -la $OUT/pyspy* ;;
  forcedab)  # issue 48: forcedtools under diagnostic arms (ARMS="base one si"): one = MLXB_GRAMMAR_ONE_LAUNCH=1 (forward
             # and masked sampling in one launch), si = MLXB_SWITCH_INTERVAL=0.0005 (the GIL handed over 10x as often)
    for arm in ${ARMS:-base one si}; do
      echo "=== arm $arm"; mkdir -p "$OUT/$arm"
      case $arm in one) export MLXB_GRAMMAR_ONE_LAUNCH=1;; si) export MLXB_SWITCH_INTERVAL=0.0005;; esac
      (OUT="$OUT/$arm" LEVELS=${LEVELS:-8,32} REPEATS=${REPEATS:-2} TAIL=0 TRACE_TAIL=0 bash "$0" forcedtools | grep -A3 "decode_only_free_ms\|decode_only_grammar_ms")
      unset MLXB_GRAMMAR_ONE_LAUNCH MLXB_SWITCH_INTERVAL
      python3 - "$OUT/$arm" <<'PY'
import glob, sys, tarfile, io
import pandas as pd
t = tarfile.open(glob.glob(sys.argv[1] + "/forcedtools-results.tgz")[0])
names = sorted(n for n in t.getnames() if n.endswith("requests.parquet"))
d = pd.read_parquet(io.BytesIO(t.extractfile(names[-1]).read()))
d = d[~d.tools]
print(d.groupby(["concurrency", "cell", "repeat"]).tpot.median().unstack("cell").to_string())
PY
    done ;;
  specsweep)  # issue 50: the controller against fixed K at chosen acceptances (replay proposer), B=1,8,32, one process
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    timeout ${LIMIT:-420} python3 -m mlxb.commands.main bench spec -m /var/tmp/$m --fixed-k ${FIXED:-2,4,8} \
      --replay-miss ${MISSES:-0,0.1,0.3,0.6,1.0} --batches ${BATCHES:-1,8,32} --spec-max-batch 64 --num-draft-tokens ${K:-8} \
      --context 512 --gen ${GEN:-64} --repeats ${REPEATS:-3} --out "$OUT/spec-sweep.json" 2>&1 | grep -v Warning | tail -${TAIL:-40} ;;
  toolmask)  # issue 48: the engine step with every 2nd row forced to call a tool against all rows free, in process
             # (ARMS="base one t2": as shipped, one launch a step, llguidance's pool at 2 threads; ROUNDS interleaves them)
    m=synth-llama-8b
    [ -d /var/tmp/$m ] || { t0=$(date +%s); mlxb models build $m --out /var/tmp/$m >/dev/null; echo "built $m in $(( $(date +%s) - t0 ))s"; }
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout ${LIMIT:-150} python3 scripts/grammar_cost.py /var/tmp/$m --batches ${BATCHES:-8,32} --steps 32 \
      --every 2 --grammar tool --arms ${ARMS:-base} --rounds ${ROUNDS:-1} --out "$OUT/toolmask.json" 2>&1 | grep -v Warning ;;
esac
