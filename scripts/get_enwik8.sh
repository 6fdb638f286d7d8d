#!/usr/bin/env bash
# Download enwik8 (the Hutter Prize corpus, first 10^8 bytes of a 2006
# English Wikipedia dump) into data/enwik8.zip, the file configs/enwik8.toml
# reads (tvq reads the zip directly; no need to unpack it).
#
#   scripts/get_enwik8.sh [DEST_DIR]     (default: data/)
set -euo pipefail

url="http://mattmahoney.net/dc/enwik8.zip"
dest_dir="${1:-data}"
dest="$dest_dir/enwik8.zip"
mkdir -p "$dest_dir"

if [[ -f "$dest" ]]; then
    echo "$dest already exists"
else
    tmp="$dest.part"
    # Resume a partial download; rename only once it is complete.
    curl --fail --location --continue-at - --output "$tmp" "$url"
    mv "$tmp" "$dest"
fi

# The zip holds one member, enwik8, of exactly 10^8 bytes.
size=$(unzip -l "$dest" enwik8 | awk '$4 == "enwik8" { print $1 }')
if [[ "$size" != "100000000" ]]; then
    echo "error: $dest does not hold a 100000000-byte enwik8 (found: ${size:-nothing}); delete it and retry" >&2
    exit 1
fi
echo "ok: $dest (enwik8, 100000000 bytes). Train with:"
echo "  tvq train --config configs/enwik8.toml --set data.path=$dest"
