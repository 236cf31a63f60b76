# Sourced by the GPU session scripts: make_variant DIR [PATCH...] copies src to DIR/src and applies
# the named patches of tools/gpu/patches/ in order (tests/test_kernel_patches_apply.py checks they
# apply); exits the script if one does not.
make_variant() {
  local dir=$1; shift
  rm -rf "$dir" && mkdir -p "$dir" && cp -r src "$dir/" || { echo "copy to $dir failed"; exit 1; }
  for p in "$@"; do
    patch -s -d "$dir/src" -p2 < "tools/gpu/patches/$p.patch" || { echo "patch $p failed"; exit 1; }
  done
}
