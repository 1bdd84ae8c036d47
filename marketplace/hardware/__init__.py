"""Hardware access (NVML, Triton) behind one interface with real and simulated backends."""
