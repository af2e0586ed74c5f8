#!/bin/sh
# Write NAME.deskvm.json next to NAME.qcow2 (what `deskvm image import` reads, see
# vm_images/importer.py): the recipe's import metadata (deskvm-image.json from
# `deskvm image files`) plus how the image boots and what built it.
#
# Usage: write-metadata.sh GUEST_FILES_DIR OUTPUT_DIR NAME BOOT GUEST_OS
set -eu
files=$1 out=$2 name=$3 boot=$4 guest_os=$5
python3 - "$files/deskvm-image.json" "$out/$name.deskvm.json" "$boot" "$guest_os" <<'PY'
import json, sys
source, target, boot, guest_os = sys.argv[1:]
meta = json.load(open(source, encoding="utf-8"))
meta.update(boot=boot, guest_os=guest_os, built_by="packer")
with open(target, "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=2)
    f.write("\n")
PY
echo "wrote $out/$name.deskvm.json"
