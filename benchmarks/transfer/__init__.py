"""Transfer benchmark: gRPC bytes vs CUDA IPC between prefill and decode, each against its anchor."""
