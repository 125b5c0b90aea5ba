"""The FUSE front end: the bridge from nodes to requests, the wire (ABI, connection, kernel engine, splice, mount) and the pyfuse3 engine."""
