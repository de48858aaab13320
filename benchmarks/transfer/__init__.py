"""Transfer benchmark: gRPC bytes vs CUDA IPC between prefill and decode (issue 9)."""
