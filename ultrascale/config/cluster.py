"""``conf/cluster/``: the hardware a plan or a dry run speaks for."""

from __future__ import annotations

from dataclasses import dataclass

from ultrascale.config.fields import num


@dataclass
class ClusterConfig:
    """The hardware a plan is for. Bandwidths are achieved bus bandwidths per GPU (what NCCL's busbw reports),
    not marketing peaks, because the time model divides bytes by them directly."""

    name: str = "h100_8x"
    """Preset name, shown in the plan's header."""
    card: str | None = "H100 SXM5 80GB"
    """The GPU, as a row of ``ultrascale.runtime.gpu.CARDS`` (or a torch device name): its compute capability and SMs
    decide the GPU levers (attention and loss kernels, activation checkpointing) a dry run states for it
    (``ultrascale.runtime.gpu.GpuInfo.from_cluster``). null: the ranks are CPUs (``cpu_local``)."""
    gpus_per_node: int = num(8, ge=1)
    """Accelerators per node: tensor parallelism stays inside one (it all-reduces twice per layer)."""
    nodes: int = num(1, ge=1)
    """Nodes; world size = gpus_per_node * nodes."""
    gpu_memory_gib: float = num(80.0, gt=0)
    """Device memory per accelerator (GiB) that a layout's peak must fit under."""
    reserved_gib: float = num(1.0, ge=0)
    """Memory the runtime takes before training allocates anything (CUDA context, NCCL/communicator buffers)."""
    host_memory_gib: float = num(2048.0, gt=0)
    """Host memory per node (GiB): ZeRO-Offload state must fit here, shared by the node's ranks."""
    peak_tflops: float = num(989.0, gt=0)
    """Dense 16-bit peak per accelerator (TFLOP/s); MFU is measured against it."""
    matmul_efficiency: float = num(0.55, gt=0, le=1)
    """Achieved fraction of peak for a training step's mix of matmuls and elementwise kernels."""
    intra_node_gbps: float = num(450.0, gt=0)
    """Achieved all-reduce bus bandwidth inside a node (GB/s per GPU; NVLink 4 ~ 450-480)."""
    inter_node_gbps: float = num(45.0, gt=0)
    """Achieved bus bandwidth across nodes (GB/s per GPU; 400 Gb/s InfiniBand per GPU ~ 45)."""
    host_link_gbps: float = num(25.0, gt=0)
    """Host<->device copy bandwidth (GB/s) used by offload."""
    intra_node_latency_us: float = num(10.0, ge=0)
    """Per-collective latency inside a node."""
    inter_node_latency_us: float = num(25.0, ge=0)
    """Per-collective latency across nodes."""
    measure_peak: bool = False
    """Measure ``peak_tflops`` on this machine at plan time (a timed matmul); for ``cluster=cpu_local``."""
    node_mtbf_hours: float = num(5000.0, gt=0)
    """Mean time between failures of one node (GPU, host, link); a job on N nodes fails N times as often. Llama 3
    405B's pretraining saw 466 interruptions in 54 days on 2,000 8-GPU nodes: about 5,600 hours a node. Sets the
    suggested checkpoint interval (Young/Daly)."""
    storage_write_gbps: float = num(2.0, gt=0)
    """Checkpoint write rate of one node to the shared file system (GB/s), all its ranks together."""
