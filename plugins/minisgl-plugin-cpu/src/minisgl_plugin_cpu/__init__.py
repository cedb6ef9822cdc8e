"""Native C kernels for minisgl on CPU: the kernel set ``native`` and the attention backend ``cpu``."""
