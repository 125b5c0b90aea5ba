"""The HTTP front end: an HTTP/1.1 server on trio and the app that answers from a tree."""
