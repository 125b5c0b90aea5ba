"""webKnossos wrap (WKW) datasets shown as unsharded Neuroglancer precomputed volumes."""
