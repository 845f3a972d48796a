"""The process and its devices: which accelerator and backend, what the CPU and GPU are, ranks and ports, shared
memory, host-memory and FLOP/s measurements. Facts about the machine, read in one place; no policy."""
