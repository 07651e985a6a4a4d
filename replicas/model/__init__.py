"""The forward and what it needs: the model's layers over our KV layout (``llama_forward``), the
slots' caches and their sessions (``batch_kv``, ``kv_cache``, ``kv_session``, ``session_pool``,
``kv_memory``), the tree masks, the CPU kernels (``cpu_attention``, ``cpu_row_ops``,
``small_gemm``, ``int8_linear``, ``native_kernels``, ``native_memory``, ``kernels/``), CUDA graphs,
host values sent to the device without waiting (``transfer``), and pictures as token ids
(``image_tokens``, ``mrope``). It imports nothing else of ``replicas``: the step, the scheduler,
the drafts and the deployments sit above it."""
