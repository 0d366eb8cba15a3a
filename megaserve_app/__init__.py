"""The application layer: the `megaserve` CLI, the local stack, process launching, benchmarks
and the public-API client. It sits on top of the services and the core library; nothing
below imports it."""
