"""Apply PyTorch's own parallelism over the gangs: DDP or FSDP2 over `gangs.dp`."""

from gangs.parallel.data import data_parallel, is_data_parallel

__all__ = ["data_parallel", "is_data_parallel"]
