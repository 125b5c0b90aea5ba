"""The fsspec front end: any virtual tree as a synchronous fsspec filesystem, served by a trio loop
in a background thread (no mount, no FUSE, no daemon)."""
