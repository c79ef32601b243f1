// Host side of one fused grouped GEMM: a setup kernel turns the device-resident
// cumulative offsets into CUTLASS's per-group problem shapes, pointers and strides
// (no host sync, no copy of the offsets to the host), then the ptr-array kernel runs
// with its problem shapes in device memory only (a persistent grid of one CTA per SM,
// which walks the groups on the device; empty groups have no tiles).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/gemm/moe_gemm_sm90.cuh"

namespace expertact::gemm {

namespace detail_run {

inline int sm_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0)
    return 0;
  return n;
}

constexpr size_t round_up(size_t n) { return (n + 255) / 256 * 256; }

// How many clusters of the kernel fit on the device at once, with its real shared-memory
// size (CUTLASS's own query passes 0 bytes and so over-counts). The persistent grid is
// sized to it: on a GPU whose SMs do not all pair into clusters, a grid of one CTA per SM
// would leave clusters waiting for others to finish. Queried once per device; 0 (unknown)
// leaves CUTLASS's default of one CTA per SM.
template <class Kernel>
int max_active_clusters(int device) {
  static int cache[64] = {};  // per device; -1: the query failed
  if (device < 0 || device >= 64) return 0;
  if (cache[device] == 0) {
    const void* k = reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>);
    const int smem = static_cast<int>(Kernel::SharedStorageSize);
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = size<0>(typename Kernel::ClusterShape{});
    attr.val.clusterDim.y = size<1>(typename Kernel::ClusterShape{});
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(attr.val.clusterDim.x, attr.val.clusterDim.y, 1);
    cfg.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, k, &cfg) != cudaSuccess || n <= 0) {
      cudaGetLastError();  // not sticky: clear it
      n = -1;
    }
    cache[device] = n;
  }
  return cache[device] > 0 ? cache[device] : 0;
}

// Expert e's rows [start, end) from the cumulative offsets, clamped to [0, T] and
// non-decreasing, so that offsets that break the contract give wrong rows, never
// accesses outside the tensors (the Python layer checks them on the host first).
template <class G, class ElementDPtr>
__global__ void setup_groups(GroupedShape s, const int32_t* offsets,
                             typename ProblemShape::UnderlyingProblemShape* shapes,
                             const Bf16** pa, const Bf16** pb, ElementDPtr* pd,
                             typename G::StrideA* sa, typename G::StrideB* sb,
                             typename G::StrideD* sd) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= s.E) return;
  auto clampT = [&](int64_t v, int64_t lo) { return v < lo ? lo : (v > s.T ? s.T : v); };
  const int64_t start = e == 0 ? 0 : clampT(offsets[e - 1], 0);
  const int64_t end = clampT(offsets[e], start);
  shapes[e] = make_shape(static_cast<int>(end - start), static_cast<int>(s.N), static_cast<int>(s.K));
  pa[e] = static_cast<const Bf16*>(s.a) + start * s.lda;
  pb[e] = static_cast<const Bf16*>(s.b) + e * s.ldb_e;
  if constexpr (!cute::is_same_v<ElementDPtr, void*>) {
    pd[e] = static_cast<ElementDPtr>(s.d) + start * s.ldd;
  }
  sa[e] = make_stride(s.lda, Int<1>{}, Int<0>{});
  sb[e] = make_stride(s.ldb, Int<1>{}, Int<0>{});
  sd[e] = make_stride(s.ldd, Int<1>{}, Int<0>{});
}

inline Status cutlass_fail(const char* what, cutlass::Status st) {
  return ::expertact::detail::fail(Status::kInternal, "fused grouped GEMM: ", what,
                                   " returned ", cutlassGetStatusString(st));
}

}  // namespace detail_run

// Runs GroupedGemm<Callbacks, ElementD, Sched> over s with the epilogue's parameters.
// ElementD = Bf16: D is stored (gate_up); void: no D (backward).
template <class Callbacks, class ElementD, class Sched>
Status run_grouped(const GroupedShape& s, const typename Callbacks::Params& ep,
                   const int32_t* offsets, cudaStream_t stream) {
  using G = GroupedGemm<Callbacks, ElementD, Sched>;
  using Gemm = typename G::Gemm;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using DPtr = cute::conditional_t<cute::is_void_v<ElementD>, void*, ElementD*>;
  namespace dr = detail_run;

  const int sms = dr::sm_count(s.device);
  if (sms == 0) return cuda::cuda_check(cudaGetLastError(), "cudaDeviceGetAttribute(SM count)");
  cutlass::KernelHardwareInfo hw;
  hw.device_id = s.device;
  hw.sm_count = sms;
  hw.max_active_clusters = dr::max_active_clusters<typename G::Kernel>(s.device);

  const size_t E = static_cast<size_t>(s.E);
  // One block of device memory: the per-group arrays, then CUTLASS's workspace (its
  // per-SM tensor maps; about 70 KB on 132 SMs).
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += dr::round_up(bytes);
    return at;
  };
  const size_t o_shapes = take(E * sizeof(Shape3)), o_pa = take(E * sizeof(void*)),
               o_pb = take(E * sizeof(void*)), o_pd = take(E * sizeof(void*)),
               o_sa = take(E * sizeof(typename G::StrideA)),
               o_sb = take(E * sizeof(typename G::StrideB)),
               o_sd = take(E * sizeof(typename G::StrideD));

  auto make_args = [&](char* base) {
    auto at = [&](size_t o) { return base == nullptr ? nullptr : base + o; };
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {s.E, reinterpret_cast<Shape3*>(at(o_shapes)), nullptr},  // no host copy of the shapes
        {reinterpret_cast<const Bf16**>(at(o_pa)), reinterpret_cast<typename G::StrideA*>(at(o_sa)),
         reinterpret_cast<const Bf16**>(at(o_pb)), reinterpret_cast<typename G::StrideB*>(at(o_sb))},
        {ep, nullptr, nullptr, reinterpret_cast<DPtr*>(at(o_pd)),
         reinterpret_cast<typename G::StrideD*>(at(o_sd))},
        hw};
    return args;
  };
  const size_t cutlass_bytes = Gemm::get_workspace_size(make_args(nullptr));
  const size_t o_ws = take(cutlass_bytes);

  char* base = nullptr;
  EA_TRY(cuda::cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&base), off, stream),
                          "cudaMallocAsync (grouped GEMM workspace)"));
  Status result = Status::kOk;
  do {
    const int threads = 128;
    dr::setup_groups<G, DPtr><<<static_cast<unsigned>((E + threads - 1) / threads), threads, 0,
                                stream>>>(
        s, offsets, reinterpret_cast<Shape3*>(base + o_shapes),
        reinterpret_cast<const Bf16**>(base + o_pa), reinterpret_cast<const Bf16**>(base + o_pb),
        reinterpret_cast<DPtr*>(base + o_pd), reinterpret_cast<typename G::StrideA*>(base + o_sa),
        reinterpret_cast<typename G::StrideB*>(base + o_sb),
        reinterpret_cast<typename G::StrideD*>(base + o_sd));
    result = cuda::cuda_check(cudaGetLastError(), "grouped GEMM setup kernel launch");
    if (result != Status::kOk) break;
    auto args = make_args(base);
    Gemm gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess) {
      result = dr::cutlass_fail("can_implement", st);
      break;
    }
    st = gemm.initialize(args, base + o_ws, stream);
    if (st != cutlass::Status::kSuccess) {
      result = dr::cutlass_fail("initialize", st);
      break;
    }
    st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess) {
      result = dr::cutlass_fail("run", st);
      break;
    }
    result = cuda::cuda_check(cudaGetLastError(), "fused grouped GEMM launch");
  } while (false);
  // Stream-ordered: freed after the kernel that reads it.
  const Status freed = cuda::cuda_check(cudaFreeAsync(base, stream), "cudaFreeAsync");
  return result != Status::kOk ? result : freed;
}

namespace detail {
template <Activation A, Schedule S>
Status fwd(const GroupedShape& s, const FwdEpilogueParams& p, void* stream) {
  return run_grouped<GluFwdCallbacks<A>, Bf16, ScheduleOf<S>>(s, p, p.offsets,
                                                             static_cast<cudaStream_t>(stream));
}
template <Activation A, Schedule S>
Status bwd(const GroupedShape& s, const BwdEpilogueParams& p, void* stream) {
  return run_grouped<GluBwdCallbacks<A>, void, ScheduleOf<S>>(s, p, p.offsets,
                                                              static_cast<cudaStream_t>(stream));
}
}  // namespace detail

}  // namespace expertact::gemm
