import os

# Without a GPU the kernels run under Triton's interpreter, which must be on before kp_losses imports.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
