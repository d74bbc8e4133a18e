"""The node's GPUs: NVML and simulated discovery, MIG, topology, health, GPU-model choice."""
