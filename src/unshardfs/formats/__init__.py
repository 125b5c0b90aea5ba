"""The format plug-ins: one package each, none importing another (see `unshardfs.core.registry`)."""
