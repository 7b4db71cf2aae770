"""The op set: torch.library custom ops, their CPU references, fused-op qualification, Triton kernels."""
