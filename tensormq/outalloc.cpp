// The CPU allocator hook behind Note [Outputs made in a slot] (tensormq/outalloc.py).
//
// It wraps the CPU allocator PyTorch had when install() ran. While one thread has *armed* some
// regions (free TensorMQ slots' data areas), an allocation made by that thread of exactly the
// armed size is given the first region no storage holds instead of heap memory; every other allocation goes to the
// wrapped allocator untouched. The region's memory belongs to the slot's mapping: the deleter
// never frees it, it only records that no storage holds the region any more.
//
// Python keeps the other half of the contract: a region is never unmapped or reused while
// held(ptr) is true, and forget(ptr) is called before its mapping goes.
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

struct Region {
  size_t size;
  bool held;
};

std::mutex mu;
std::unordered_map<uintptr_t, Region> regions;  // every region ever armed and not forgotten
std::atomic<bool> armed{false};                 // the fast path of every allocation reads only this
std::thread::id armed_thread;
std::vector<uintptr_t> armed_ptrs;              // the regions lent to the current model call
size_t armed_size = 0;
int64_t takes = 0;                              // allocations given a region since arm()
std::atomic<int64_t> n_held{0};                 // regions a storage holds now: read without the lock
c10::Allocator* wrapped = nullptr;

void mark_free(Region& r) {
  if (r.held) {
    r.held = false;
    n_held.fetch_sub(1, std::memory_order_relaxed);
  }
}

void release_region(void* ctx) {
  std::lock_guard<std::mutex> g(mu);
  auto it = regions.find(reinterpret_cast<uintptr_t>(ctx));
  if (it != regions.end()) mark_free(it->second);
}

// raw_allocate() (oneDNN's scratch memory, among others) hands out allocate()'s pointer and
// frees it later through raw_deleter(): a region goes back to its slot, anything else to the
// wrapped allocator's own deleter.
void raw_delete(void* p) {
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = regions.find(reinterpret_cast<uintptr_t>(p));
    if (it != regions.end()) {
      mark_free(it->second);
      return;
    }
  }
  wrapped->raw_deleter()(p);
}

struct SlotLender final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (armed.load(std::memory_order_acquire) && n != 0) {
      std::lock_guard<std::mutex> g(mu);
      if (armed.load(std::memory_order_relaxed) && n == armed_size &&
          std::this_thread::get_id() == armed_thread) {
        for (uintptr_t key : armed_ptrs) {
          auto it = regions.find(key);
          if (it != regions.end() && !it->second.held) {
            it->second.held = true;
            n_held.fetch_add(1, std::memory_order_relaxed);
            ++takes;
            void* p = reinterpret_cast<void*>(key);
            return {p, p, &release_region, c10::Device(c10::DeviceType::CPU)};
          }
        }
      }
    }
    return wrapped->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return wrapped->raw_deleter() != nullptr ? &raw_delete : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

SlotLender lender;

void install() {
  std::lock_guard<std::mutex> g(mu);
  if (wrapped != nullptr) return;
  wrapped = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&lender, /*priority=*/UINT8_MAX);
  TORCH_CHECK(c10::GetCPUAllocator() == &lender, "blockflow: the CPU allocator could not be wrapped");
}

void arm(std::vector<int64_t> ptrs, std::vector<int64_t> capacities, int64_t size) {
  TORCH_CHECK(wrapped != nullptr, "blockflow: arm() before install()");
  TORCH_CHECK(!ptrs.empty() && ptrs.size() == capacities.size(), "blockflow: one capacity per lent region");
  std::lock_guard<std::mutex> g(mu);
  armed_ptrs.clear();
  for (size_t i = 0; i < ptrs.size(); ++i) {
    TORCH_CHECK(ptrs[i] != 0 && ptrs[i] % 64 == 0, "blockflow: a lent region must be 64-byte aligned");
    TORCH_CHECK(size > 0 && size <= capacities[i], "blockflow: the armed size must fit every region");
    auto key = static_cast<uintptr_t>(ptrs[i]);
    auto it = regions.find(key);
    if (it == regions.end()) {
      regions.emplace(key, Region{static_cast<size_t>(capacities[i]), false});
    } else {
      TORCH_CHECK(it->second.size == static_cast<size_t>(capacities[i]),
                  "blockflow: region registered with another size");
    }
    armed_ptrs.push_back(key);
  }
  armed_thread = std::this_thread::get_id();
  armed_size = static_cast<size_t>(size);
  takes = 0;
  armed.store(true, std::memory_order_release);
}

int64_t disarm() {
  std::lock_guard<std::mutex> g(mu);
  armed.store(false, std::memory_order_release);
  armed_ptrs.clear();
  armed_size = 0;
  return takes;
}

bool held(int64_t ptr) {
  std::lock_guard<std::mutex> g(mu);
  auto it = regions.find(static_cast<uintptr_t>(ptr));
  return it != regions.end() && it->second.held;
}

bool forget(int64_t ptr) {
  std::lock_guard<std::mutex> g(mu);
  auto it = regions.find(static_cast<uintptr_t>(ptr));
  if (it == regions.end()) return true;
  if (it->second.held) return false;
  regions.erase(it);
  return true;
}

int64_t held_count() { return n_held.load(std::memory_order_relaxed); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "BlockFlow: lend TensorMQ slots to the CPU allocator (Note [Outputs made in a slot])";
  m.def("install", &install, "wrap PyTorch's CPU allocator (once per process)");
  m.def("arm", &arm, "for this thread: an allocation of exactly `size` bytes may take one of these regions",
        py::arg("ptrs"), py::arg("capacities"), py::arg("size"));
  m.def("disarm", &disarm, "end the lend; how many allocations were given a region since arm()");
  m.def("held", &held, "whether a storage holds region `ptr`");
  m.def("forget", &forget, "drop region `ptr` (its mapping goes); False while a storage holds it");
  m.def("held_count", &held_count, "how many regions storages hold now (0: every lent slot is free of them)");
}
