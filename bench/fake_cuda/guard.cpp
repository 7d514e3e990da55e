// A fake CUDA device for FakeTensorMode on a CPU-only PyTorch (bench/fake_cuda/README.md).
// 1. c10's FakeGuardImpl as the CUDA device guard: a CUDA build installs it when it sees no device;
//    a CPU-only build installs none and autograd aborts on a fake "cuda" tensor.
// 2. CUDA hooks whose hasCUDA() is true, so that autograd's engine finds an accelerator; nothing
//    here touches a device.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;
c10::impl::DeviceGuardImplRegistrar registrar(c10::DeviceType::CUDA, &guard);

struct FakeCUDAHooks : at::CUDAHooksInterface {
  FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  int getNumGPUs() const override { return 1; }
};
}  // namespace

namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks)
}

extern "C" int fake_cuda_ready() {
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) && at::detail::getCUDAHooks().hasCUDA();
}
