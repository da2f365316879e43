"""File IO of tensors at the disk's rate, below the trainer: `direct_writes` (files written
past the page cache), `tensor_bytes` (a file's bytes read straight into a tensor's memory),
`dcp_records` (a DCP checkpoint's tensors read into their targets), `crc32c` (a buffer
hashed in place), `plain_values` (a DCP save planner)."""
