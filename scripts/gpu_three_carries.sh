#!/usr/bin/env bash
# The working tree (about 26 MB tracked at stop 40) plus one of ../shared/gpu/prepare.sh's two 44 MB carries is
# over the device tool's 64 MiB: re-split the MLX CUDA wheel into three ~30 MB parts after prepare.sh ran.
#   bash ../shared/gpu/prepare.sh && bash scripts/gpu_three_carries.sh
# then on the H200, one command each, while the machine stays warm:
#   carry .whl/a:  bash .whl/a/stash.sh   (first: it copies; .whl/e appends to what it copied)
#   carry .whl/e:  bash .whl/e/stash.sh
#   carry .whl/c:  bash .whl/c/stash.sh   (before .whl/f, which appends to it)
#   carry .whl/f:  bash .whl/f/stash.sh
#   carry .whl/d:  bash .whl/d/stash.sh
#   carry .whl/b:  source .whl/b/install.sh && <your command>
# With reports/ and goldens/ moved out of the tree first (the rest of the tracked tree is ~2.5 MB at stop 64; goldens/
# alone is ~16 MB, and with it the second call below is over 64 MiB: `mkdir -p /tmp/hold && mv reports goldens
# /tmp/hold/`, and back after; never commit while they are out), two calls carry it all (~48 and ~53 MB), which
# matters when a machine stays lent for minutes only:
#   carry .whl/a .whl/e .whl/c:  bash .whl/a/stash.sh && bash .whl/e/stash.sh && bash .whl/c/stash.sh
#   carry .whl/f .whl/d .whl/b:  bash .whl/f/stash.sh && bash .whl/d/stash.sh && source .whl/b/install.sh && <command>
# Targets that start `mlxb serve` (bench load) need the server's wheels, which the device lacks; name them to
# prepare.sh as extras (stop 39 also carried fastapi and pydantic, which mlxb does not import; with them .whl/b
# plus the tree went over 64 MiB at stop 40, so leave them out):
#   bash ../shared/gpu/prepare.sh starlette==1.10.0 uvicorn==0.55.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 \
#     click==8.5.1 prometheus-client==0.26.0 llguidance==1.9.1 jsonschema jsonschema-specifications referencing \
#     rpds-py attrs && bash scripts/gpu_three_carries.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.whl"
[ -f a/mlx_cuda.part.0 ] && [ -f b/mlx_cuda.part.1 ] || { echo "run ../shared/gpu/prepare.sh first"; exit 2; }
cat a/mlx_cuda.part.0 b/mlx_cuda.part.1 > /tmp/mlx_cuda_whole.whl
echo "$(cat b/mlx_cuda.sha256)  /tmp/mlx_cuda_whole.whl" | sha256sum -c --quiet -
rm a/mlx_cuda.part.0 b/mlx_cuda.part.1
# four parts since stop 52 (the tracked tree grew past what .whl/b's 30 MB part left room for): a, c, d are
# stashed on the device one call each, b (the smallest part, plus the extra wheels) installs
split -b 30000000 -d -a 1 /tmp/mlx_cuda_whole.whl /tmp/mlx_cuda_part.
split -b 15000000 -d -a 1 /tmp/mlx_cuda_part.2 /tmp/mlx_cuda_tail.
mkdir -p c d
mv /tmp/mlx_cuda_part.0 a/mlx_cuda.part.0
mv /tmp/mlx_cuda_part.1 c/mlx_cuda.part.1
mv /tmp/mlx_cuda_tail.0 b/mlx_cuda.part.2
mv /tmp/mlx_cuda_tail.1 d/mlx_cuda.part.3
rm /tmp/mlx_cuda_whole.whl /tmp/mlx_cuda_part.2
for n in c:1 d:3; do
  dir=${n%%:*}; k=${n##*:}
  cat > $dir/stash.sh <<EOS
#!/usr/bin/env bash
set -eu
mkdir -p /var/tmp/mlxb-stash
cp .whl/$dir/mlx_cuda.part.$k /var/tmp/mlxb-stash/
echo "stashed part $k; next: the other stash commands, then the install command (carry .whl/b)"
EOS
  chmod +x $dir/stash.sh
done
# five since stop 53 (the tree reached 34 MiB): part 0 goes in two halves, a (copied) then e (appended)
split -b 15000000 -d -a 1 a/mlx_cuda.part.0 /tmp/mlx_cuda_head.
mkdir -p e
mv /tmp/mlx_cuda_head.0 a/mlx_cuda.part.0a
mv /tmp/mlx_cuda_head.1 e/mlx_cuda.part.0b
rm a/mlx_cuda.part.0
sed -i 's|cp .whl/a/mlx_cuda.part.0 /var/tmp/mlxb-stash/|cp .whl/a/mlx_cuda.part.0a /var/tmp/mlxb-stash/mlx_cuda.part.0|' a/stash.sh
grep -q 'part.0a' a/stash.sh || { echo "a/stash.sh was not rewritten"; exit 3; }
printf '#!/usr/bin/env bash\nset -eu\ncat .whl/e/mlx_cuda.part.0b >> /var/tmp/mlxb-stash/mlx_cuda.part.0\necho "appended part 0b"\n' > e/stash.sh
chmod +x e/stash.sh
sed -i 's|cat "$p0" .whl/b/mlx_cuda.part.1 > "$w"|cat "$p0" /var/tmp/mlxb-stash/mlx_cuda.part.1 .whl/b/mlx_cuda.part.2 /var/tmp/mlxb-stash/mlx_cuda.part.3 > "$w"|' b/install.sh
grep -q 'mlx_cuda.part.3' b/install.sh || { echo "install.sh was not rewritten"; exit 3; }
# six since stop 54 (goldens of the shared case: the tree reached 34 MiB and .whl/c's 30 MB went over): part 1 goes in
# two halves too, c (copied) then f (appended)
split -b 15000000 -d -a 1 c/mlx_cuda.part.1 /tmp/mlx_cuda_one.
mkdir -p f
mv /tmp/mlx_cuda_one.0 c/mlx_cuda.part.1a
mv /tmp/mlx_cuda_one.1 f/mlx_cuda.part.1b
rm c/mlx_cuda.part.1
sed -i 's|cp .whl/c/mlx_cuda.part.1 /var/tmp/mlxb-stash/|cp .whl/c/mlx_cuda.part.1a /var/tmp/mlxb-stash/mlx_cuda.part.1|' c/stash.sh
grep -q 'part.1a' c/stash.sh || { echo "c/stash.sh was not rewritten"; exit 3; }
printf '#!/usr/bin/env bash\nset -eu\ncat .whl/f/mlx_cuda.part.1b >> /var/tmp/mlxb-stash/mlx_cuda.part.1\necho "appended part 1b"\n' > f/stash.sh
chmod +x f/stash.sh
du -sh a b c d e f
