// Included before everything else when tests/metal/link_contract.py
// compiles a source: every declaration that does not say otherwise gets
// hidden visibility, as libmlx's symbols have on macOS. MLX_API
// (visibility "default") overrides it, so an undefined MLX symbol that ends
// up HIDDEN in the object is one libmlx does not export.
#pragma GCC visibility push(hidden)
