"""Reference writers and servers for tests and benchmarks (like `zarr.testing`).

These build datasets with independent implementations (TensorStore,
CloudVolume, zarr-python, a reference DVID export writer) together with an
unsharded twin of the same data, and serve directories over HTTP with fault
injection. They import their heavy dependencies (the `test` extra) only
when used; nothing in the file system itself imports this package.
"""
