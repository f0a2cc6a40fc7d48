#!/usr/bin/env bash
# Issue 19: what MLX's CUDA command batching costs a lone decode step. MLX's CUDA backend records kernels
# into CUDA graphs and launches one every MLX_MAX_OPS_PER_BUFFER kernels (20 by default); MLX_USE_CUDA_GRAPHS=0
# launches kernels one by one. Each setting is a separate process (MLX reads these once), passes alternate so
# drift shows. Prints plain B=1 ms/token (scripts/probes/compile_step_probe.py's plain arm: mlx-lm's KVCache, the
# model called per step, pipelined like generate_step).
#   on the H200, after the install:  bash scripts/probes/cuda_graph_sweep.sh  (MODELS, SETTINGS, PASSES, GEN, REPEATS)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ln -sfn ../commands mlxb/commands; ln -sfn ../oracle mlxb/oracle
for m in ${MODELS:-synth-llama-1b synth-llama-8b}; do
  [ -d /var/tmp/$m ] || python3 -m mlxb.commands.main models build $m --out /var/tmp/$m >/dev/null
  for pass in $(seq ${PASSES:-2}); do
    for s in ${SETTINGS:-20 60 120 250 off}; do
      if [ "$s" = off ]; then env="MLX_USE_CUDA_GRAPHS=0"; else env="MLX_MAX_OPS_PER_BUFFER=$s"; fi
      r=$(env $env timeout ${LIMIT:-90} python3 scripts/probes/compile_step_probe.py /var/tmp/$m --gen ${GEN:-128} \
          --repeats ${REPEATS:-3} --only none 2>&1 | grep -E "^  plain" | sed 's/plain\/this.*//')
      echo "$m pass $pass $env: $r"
    done
  done
done
