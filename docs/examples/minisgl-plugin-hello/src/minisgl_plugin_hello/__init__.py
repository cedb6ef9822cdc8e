"""minisgl-plugin-hello: an example minisgl plugin providing the 'hello' attention backend."""

__version__ = "0.1.0"
