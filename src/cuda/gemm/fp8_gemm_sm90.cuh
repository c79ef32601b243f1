// The FP8 blockwise grouped GEMM on Hopper: CUTLASS's sm90 ptr-array grouped kernel with
// its FP8 blockwise mainloop (every 128-deep K tile accumulated in the tensor cores, then
// added into FP32 registers scaled by sa * sb: the promotion), cooperative 128 x 128 x 128
// tiles, clusters of 1 x 2, a bf16 epilogue with no source. Two instantiations, one per
// grouping, each in its own translation unit (fp8_gemm_m.cu, fp8_gemm_k.cu) compiled for
// sm_90a only; they differ in B's scale granularity alone (below).
//
// A device kernel builds the per-group problem list from the offsets (fp8_gemm_plan.h), so
// the host never reads them: the GEMM runs with its problem shapes in device memory only,
// a persistent grid walking the groups on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/gemm/fp8_gemm_args.cuh"
#include "cuda/gemm/fp8_gemm_plan.h"

namespace expertact::fp8gemm {

using namespace cute;

// CUTLASS's sm90 FP8 blockwise ptr-array mainloop builds each group's scale tensors as
// compact [K / 128, M] blocks from the group's (M, N, K) and ignores the per-group scale
// layouts it is given. The recipe's row-tile scales are one [KB, T] matrix over all experts'
// rows (the stride between K blocks is T, not the group's M), so this mainloop takes every
// group's scale pointer and layout from the arrays the builder filled (the arguments'
// ptr_SFA / layout_SFA, one per group); the rest is CUTLASS's collective unchanged. The two
// functions replace the base's own (the kernel calls them by name on this type): load_init
// once before the first group and tensors_perform_update at every change of group, before
// any load of that group.
template <class Base>
struct PerGroupScaleMainloop : Base {
  using Params = typename Base::Params;
  using TileShape = typename Base::TileShape;

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& shape, Params const& params) const {
    // The first group's views are replaced before any load (the kernel's producers start
    // with a change of group), so no scale pointer is read here.
    return views(shape, params, nullptr, nullptr, typename Base::InternalLayoutSFA{},
                 typename Base::InternalLayoutSFB{});
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const&, Params const& params,
                                                     ProblemShape_MNKL shape, int32_t group) const {
    return views(shape, params, params.ptr_SFA[group], params.ptr_SFB[group], params.layout_SFA[group],
                 params.layout_SFB[group]);
  }

 private:
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto views(ProblemShape_MNKL const& shape, Params const& params, float const* sfa,
                            float const* sfb, typename Base::InternalLayoutSFA const& layout_sfa,
                            typename Base::InternalLayoutSFB const& layout_sfb) const {
    using X = Underscore;
    auto [M, N, K, L] = shape;
    Tensor mA = params.tma_load_a.get_tma_tensor(make_shape(M, K, 1));
    Tensor mB = params.tma_load_b.get_tma_tensor(make_shape(N, K, 1));
    Tensor gA = local_tile(mA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BLK_M,BLK_K,m,k,l)
    Tensor gB = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BLK_N,BLK_K,n,k,l)
    Tensor mSFA = make_tensor(make_gmem_ptr(sfa), layout_sfa);  // (scale_m, scale_k, l)
    Tensor mSFB = make_tensor(make_gmem_ptr(sfb), layout_sfb);
    return cute::make_tuple(gA, gB, mSFA, mSFB);
  }
};

using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group

// The epilogue, the same in both instantiations: D = the float32 accumulator rounded once to
// bfloat16, stored by TMA; no source C.
using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor*, 8,
    ElementD, cutlass::layout::RowMajor*, 8, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

// CUTLASS's FP8 blockwise mainloop for the scale layouts of ScaleConfig (A's always 1 x 128,
// m-major): A [M, K] and B [N, K], K contiguous.
template <class ScaleConfig>
using MainloopBuilder = cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cute::tuple<cutlass::layout::RowMajor*, typename ScaleConfig::LayoutSFA*>, 16,
    ElementB, cute::tuple<cutlass::layout::ColumnMajor*, typename ScaleConfig::LayoutSFB*>, 16,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;

// One instantiation (fp8_gemm_m.cu, fp8_gemm_k.cu), over the builder's mainloop for it
// (spelled out at namespace scope there: the host compiler does not take the builder's
// result as a dependent type inside a template).
template <class ScaleConfig, class BaseMainloop>
struct GroupedGemm {
  using LayoutSFA = typename ScaleConfig::LayoutSFA;
  using LayoutSFB = typename ScaleConfig::LayoutSFB;
  using Mainloop = PerGroupScaleMainloop<BaseMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Args = GroupArgs<LayoutSFA, LayoutSFB>;
  static_assert(cute::is_same_v<typename Kernel::InternalStrideA, StrideRow>, "A's stride type");
  static_assert(cute::is_same_v<typename Kernel::InternalStrideB, StrideRow>, "B's stride type");
  static_assert(cute::is_same_v<typename Kernel::InternalStrideD, StrideRow>, "D's stride type");
  static_assert(cute::is_same_v<typename BaseMainloop::InternalLayoutSFA, LayoutSFA>, "SFA's layout type");
  static_assert(cute::is_same_v<typename BaseMainloop::InternalLayoutSFB, LayoutSFB>, "SFB's layout type");
  static_assert(cute::is_same_v<typename ProblemShape::UnderlyingProblemShape, Shape3>, "problem shape type");
};

// ---------------------------------------------------------------------------
// The builder kernel: block 0 fills the problem list (one thread per expert, each finding
// its own slot), the other blocks zero the output no GEMM writes (fp8_gemm_plan.h,
// zero_region). D's rows are 16-byte aligned (the boundary checks it): 8 bf16 per store.
// ---------------------------------------------------------------------------

template <class Args>
__global__ void prepare_groups(Problem p, Args args) {
  if (blockIdx.x == 0) {
    for (int64_t e = threadIdx.x; e < p.E; e += blockDim.x) build_expert(p, p.offsets, e, args);
    return;
  }
  const int64_t blocks = gridDim.x - 1, vec_per_row = p.N / 8;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) - 1) * blockDim.x + threadIdx.x;
  const int64_t stride = blocks * blockDim.x;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t i = 0, n = zero_region_count(p); i < n; ++i) {
    const ZeroRegion z = zero_region(p, p.offsets, i);
    const int64_t units = (z.row_end - z.row_begin) * vec_per_row;
    auto* base = static_cast<cutlass::bfloat16_t*>(p.d) + z.d_offset;
    for (int64_t u = first; u < units; u += stride) {
      const int64_t r = z.row_begin + u / vec_per_row, c = u % vec_per_row * 8;
      *reinterpret_cast<uint4*>(base + r * p.ldd + c) = zero;
    }
  }
}

// ---------------------------------------------------------------------------
// The launcher
// ---------------------------------------------------------------------------

// The persistent grid's bound: the workspace holds CUTLASS's per-CTA tensor maps for this
// many CTAs, so its size does not depend on the device (Hopper parts have up to 132 SMs).
constexpr int kMaxCtas = 256;

struct DeviceInfo {
  int sms = 0;            // min(SM count, kMaxCtas)
  int major = 0, minor = 0;
  int clusters = 0;       // clusters of the kernel that fit at once (0: unknown)
};

// The device's SM count and compute capability, and how many clusters of Kernel fit at
// once with its real shared memory (CUTLASS's own query passes 0 bytes and over-counts); the
// persistent grid is sized to it. Queried once per device and kernel.
template <class Kernel>
Status device_info(int device, DeviceInfo& out) {
  static DeviceInfo cache[64];
  static bool known[64] = {};
  static std::mutex mutex;
  if (device < 0 || device >= 64)
    return ::expertact::detail::fail(Status::kUnsupported, "CUDA device ", device,
                                     " is past the 64 this build handles");
  std::lock_guard<std::mutex> lock(mutex);
  if (!known[device]) {
    DeviceInfo info;
    int sms = 0;
    EA_TRY(cuda::cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                            "cudaDeviceGetAttribute(SM count)"));
    EA_TRY(cuda::cuda_check(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device),
                            "cudaDeviceGetAttribute(compute capability)"));
    EA_TRY(cuda::cuda_check(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device),
                            "cudaDeviceGetAttribute(compute capability)"));
    info.sms = sms < kMaxCtas ? sms : kMaxCtas;
    if (info.major == 9 && info.minor == 0) {
      const void* k = reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>);
      const int smem = static_cast<int>(Kernel::SharedStorageSize);
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr = {};
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = size<0>(ClusterShape{});
      attr.val.clusterDim.y = size<1>(ClusterShape{});
      attr.val.clusterDim.z = 1;
      cfg.gridDim = dim3(attr.val.clusterDim.x, attr.val.clusterDim.y, 1);
      cfg.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
      cfg.dynamicSmemBytes = static_cast<size_t>(smem);
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int n = 0;
      if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
          cudaOccupancyMaxActiveClusters(&n, k, &cfg) != cudaSuccess || n <= 0) {
        cudaGetLastError();  // not sticky: clear it; CUTLASS's default (one CTA per SM) stands
        n = 0;
      }
      info.clusters = n;
    }
    cache[device] = info;
    known[device] = true;
  }
  out = cache[device];
  return Status::kOk;
}

inline cutlass::KernelHardwareInfo hardware(int device, const DeviceInfo& info) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = info.sms;
  hw.max_active_clusters = info.clusters;
  return hw;
}

template <class G>
typename G::Gemm::Arguments gemm_arguments(const Problem& p, const typename G::Args& a,
                                           const cutlass::KernelHardwareInfo& hw) {
  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {p.E, a.shapes, nullptr},  // no host copy of the problem shapes
      {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_sfa, a.layout_sfa, a.ptr_sfb, a.layout_sfb},
      {{}, nullptr, nullptr, a.ptr_d, a.stride_d},
      hw};
  args.epilogue.thread.alpha = 1.0f;  // D = accumulator, rounded once to bf16
  args.epilogue.thread.beta = 0.0f;
  return args;
}

// CUTLASS's own workspace (its per-CTA tensor maps) for a grid of kMaxCtas CTAs.
template <class G>
size_t cutlass_workspace_bytes() {
  static const size_t bytes = [] {
    Problem p;
    p.E = 1;
    typename G::Args none{};
    cutlass::KernelHardwareInfo hw;
    hw.sm_count = kMaxCtas;
    return G::Gemm::get_workspace_size(gemm_arguments<G>(p, none, hw));
  }();
  return bytes;
}

template <class G>
size_t workspace_bytes(int64_t E) {
  return G::Args::bytes(E) + round_up(cutlass_workspace_bytes<G>());
}

inline Status cutlass_failed(const char* what, cutlass::Status st) {
  return ::expertact::detail::fail(Status::kInternal, "fp8_grouped_gemm_blockwise: CUTLASS's ", what, " returned ",
                                   cutlassGetStatusString(st));
}

// Runs the GEMM of p (validated at the API boundary, d not empty) with the workspace given
// (at least workspace_bytes<G>(E) bytes, 256-byte aligned: checked there).
template <class G>
Status run(const Problem& p, void* workspace, size_t, cudaStream_t stream) {
  cuda::DeviceGuard guard(p.device);
  EA_TRY(::expertact::detail::enter_operands(
      p.device, guard,
      {{"a", p.a}, {"a_scale", p.sfa}, {"b", p.b}, {"b_scale", p.sfb}, {"offsets", p.offsets}, {"d", p.d},
       {"workspace", workspace}}));
  DeviceInfo info;
  EA_TRY(device_info<typename G::Kernel>(p.device, info));
  if (info.major != 9 || info.minor != 0)
    return ::expertact::detail::fail(Status::kUnsupported, "fp8_grouped_gemm_blockwise runs on sm_90 GPUs (Hopper: "
                                     "H100, H200, H800, H20) only; device ", p.device, " is sm_", info.major,
                                     info.minor);
  char* base = static_cast<char*>(workspace);
  const typename G::Args args = G::Args::carve(base, p.E);
  void* cutlass_space = base + G::Args::bytes(p.E);

  prepare_groups<<<1 + info.sms, 256, 0, stream>>>(p, args);
  EA_TRY(cuda::cuda_check(cudaGetLastError(), "fp8_grouped_gemm_blockwise: the builder kernel's launch"));

  const auto gemm_args = gemm_arguments<G>(p, args, hardware(p.device, info));
  typename G::Gemm gemm;
  cutlass::Status st = gemm.can_implement(gemm_args);
  if (st != cutlass::Status::kSuccess) return cutlass_failed("can_implement", st);
  st = gemm.initialize(gemm_args, cutlass_space, stream);
  if (st != cutlass::Status::kSuccess) return cutlass_failed("initialize", st);
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) return cutlass_failed("run", st);
  return cuda::cuda_check(cudaGetLastError(), "fp8_grouped_gemm_blockwise: the GEMM's launch");
}

}  // namespace expertact::fp8gemm
