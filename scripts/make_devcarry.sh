#!/usr/bin/env bash
# Packs ray[serve] 2.60 + xgrammar for a GPU machine without a package index into ONE carry of ~43 MB
# (docs/performance.md, "Reproducing on a GPU machine without a package index"): the ray wheel less what a
# Python-only Serve deployment never loads (ray/jars: the Java runtime, already-compressed 34 MB; rllib; cpp; the
# dashboard's JS source maps) re-packed as tar.xz (79 MB wheel -> 26 MB), beside the other wheels and an install.sh
# to source on the machine. WHEELS: a directory from `pip download --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 'ray[serve]==2.60.0' 'xgrammar>=0.2.9,<0.3' -d WHEELS`.
#   WHEELS=wheels bash scripts/make_devcarry.sh      (-> .devcarry/one, gitignored; carry it: run(carry=[".devcarry/one"]))
set -euo pipefail
WHEELS=$(realpath "${WHEELS:?a directory of downloaded wheels}"); DEST=${DEST:-.devcarry/one}
mkdir -p "$DEST"; DEST=$(realpath "$DEST")
tmp=$(mktemp -d); trap 'rm -rf $tmp' EXIT
python3 -m zipfile -e "$(ls "$WHEELS"/ray-*.whl | head -1)" $tmp/x
rm -rf $tmp/x/ray/jars $tmp/x/ray/rllib $tmp/x/ray/cpp $tmp/x/ray/dashboard/client/build/static/js/*.map
(cd $tmp/x && tar cf - ray ray-*.dist-info | xz -T0 -9 > "$DEST/ray.tar.xz")
find "$WHEELS" -name "*.whl" ! -name "ray-*" -exec cp {} "$DEST"/ \;
cat > "$DEST/install.sh" <<'SH'
# Sourced on the GPU machine: Ray (tar.xz) and the other wheels into /tmp/site, on PYTHONPATH and PATH.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p /tmp/site/bin
tar xJf "$here/ray.tar.xz" -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$here"/*.whl 2>&1 | grep -v WARNING | tail -3
for cmd in "ray ray.scripts.scripts main" "serve ray.serve.scripts cli"; do set -- $cmd
  printf '#!/usr/bin/env python3\nimport sys\nfrom %s import %s\nsys.exit(%s())\n' "$2" "$3" "$3" > /tmp/site/bin/$1
  chmod +x /tmp/site/bin/$1
done
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
python3 -c 'import ray, ray.serve, xgrammar; print("ray", ray.__version__, "ready")'
SH
du -sh "$DEST"
