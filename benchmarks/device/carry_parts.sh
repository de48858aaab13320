#!/bin/bash
# Files larger than one device call can carry (the working tree and its carries travel within 64 MiB), moved in
# parts over consecutive calls while the machine stays held:
#
#   here:    bash benchmarks/device/carry_parts.sh split /tmp/nx312/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
#            (pip download nixl-cu13==1.5.1 --python-version 3.12 --only-binary=:all: --no-deps -d /tmp/nx312)
#            -> .carry-parts/<name>.part-00, -01, ... (28 MiB each, git-ignored) and .carry-parts/<name>.sha256
#   device:  call k carries .carry-parts/<name>.sha256 and one part, and runs
#            bash benchmarks/device/carry_parts.sh collect      (parts move to /tmp/carry-parts, kept between calls)
#            bash benchmarks/device/carry_parts.sh join <name> DEST   (once every part is there; checks the sha256)
#
# pipeline.sh's nixl stage joins the NIXL wheel this way when its parts have arrived. It also needs the small
# `nixl` wheel, the importable package over nixl_cu13 (pip download nixl==1.5.1 --no-deps ...: 12 KB), copied
# whole into .carry-parts/ and carried with any part: without it `import nixl` fails and every nixl row says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
STORE=${CARRY_STORE:-/tmp/carry-parts}  # where parts gather on the device
PARTS=${CARRY_PARTS:-.carry-parts}    # what a call carries (relative to the repository root)
case "${1:-}" in
  split)
    f=$(realpath "$2"); mib=${3:-28}; name=$(basename "$f"); mkdir -p "$PARTS"
    rm -f "$PARTS/$name".part-*
    split -b "${mib}M" -d -a 2 "$f" "$PARTS/$name.part-"
    (cd "$(dirname "$f")" && sha256sum "$name") > "$PARTS/$name.sha256"
    ls -la "$PARTS" ;;
  collect)
    mkdir -p "$STORE"
    if compgen -G "$PARTS/*" >/dev/null; then cp -f "$PARTS"/* "$STORE"/; fi
    ls -la "$STORE" ;;
  join)
    name=$2; dest=$3
    [ -f "$STORE/$name.sha256" ] || { echo "no $name.sha256 in $STORE: carry it with a part"; exit 1; }
    cat "$STORE/$name".part-* > "$dest/$name"
    (cd "$dest" && sha256sum -c "$STORE/$name.sha256") || { echo "$name: parts missing or corrupt"; rm -f "$dest/$name"; exit 1; } ;;
  *) echo "usage: carry_parts.sh split FILE [MiB] | collect | join NAME DEST_DIR"; exit 2 ;;
esac
