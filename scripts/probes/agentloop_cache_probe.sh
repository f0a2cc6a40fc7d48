#!/bin/bash
# An agent loop against one mlxb serve started here with the given flags (a fresh SSD dir), then its /stats:
# `CONC=32 bash scripts/probes/agentloop_cache_probe.sh LABEL --prompt-cache-size 44`; per-turn uncached tokens
# are in LABEL/reports/results/*/requests.parquet (prompt_tokens - cached_tokens by repeat and turn).
# $1: label, rest: serve flags
label=$1; shift
mkdir -p ${DIR:-/tmp/agentloop-probe}
port=$((8300 + RANDOM % 500))
rm -rf ${DIR:-/tmp/agentloop-probe}/ssd-$label
mlxb serve --port $port --batch 16 --prompt-cache-dir ${DIR:-/tmp/agentloop-probe}/ssd-$label "$@" > ${DIR:-/tmp/agentloop-probe}/serve-$label.log 2>&1 &
pid=$!
for i in $(seq 60); do curl -s localhost:$port/health | grep -q ok && break; sleep 1; done
mkdir -p ${DIR:-/tmp/agentloop-probe}/$label && cd ${DIR:-/tmp/agentloop-probe}/$label
COLUMNS=200 timeout 900 mlxb bench load -m tiny-llama --base-url http://127.0.0.1:$port/v1 --dataset agent-loop --system-len 1500 --input-len 100 --tool-len 80 --turns 4 --concurrency ${CONC:-8} --output-len 64 --repeats 2 > bench.log 2>&1
curl -s localhost:$port/stats > stats.json
kill $pid; wait $pid 2>/dev/null
