// A pool of large CPU buffers for the memory fastlazy's graph runs and
// recorded backwards allocate, so that a loop's buffers stay mapped from
// one step to the next.
//
// Why: torch's CPU allocator is malloc.  glibc serves a large block
// (above its mmap threshold, 128 KiB to 32 MiB) with fresh pages, and
// gives the top of its heap back to the system when that much is free;
// either way the next step's block of the same size is faulted in again,
// page by page.  A training step frees its gradients at `zero_grad()` and
// allocates them again in the next backward: resnet18's step at batch 1
// took 7,000-10,000 minor faults and a quarter of its time in them.
//
// How: fastlazy's CPU allocator stands in front of torch's.  It passes
// every allocation through to torch's allocator unchanged, except those of
// at least MIN_BYTES made on a thread inside a pool scope (fastlazy enters
// one around each graph run and for the backward of a graph it recorded).
// Those come from the pool: a block freed earlier, of the same size class,
// or a new block from torch's allocator.  A pooled block freed goes back to the pool, not to
// malloc, while the pool holds at most `cap` bytes of idle blocks (the
// idle blocks of other sizes are given back to make room).
//
// The allocator is installed at the first scope, not before: a process
// that never runs a graph keeps torch's allocator itself.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu_pool_scope.h"

namespace fastlazy::cpu_pool {

// Smaller blocks come from malloc's arenas, which stay mapped already.
constexpr size_t MIN_BYTES = 128 << 10;

struct Block {
  c10::DataPtr memory;   // from torch's allocator
  size_t size;           // the size class
  void* data;            // where the tensor's bytes start: memory + its colour
};

// Blocks start at COLOURS different offsets into their first page, a
// multiple of COLOUR_BYTES apart.  malloc maps a large block afresh at one
// page offset (its chunk header's), so a pool of such blocks would start
// every tensor there, and a kernel reading two while writing a third can
// stall on 4K aliasing and cache set conflicts.  (No difference was
// measurable on W4's models, whose call times move more than that from
// one process to the next; the offsets cost at most 4 KiB a block.)
constexpr size_t COLOURS = 32;
constexpr size_t COLOUR_BYTES = 128;

struct Stats {
  int64_t hits = 0, misses = 0, returned = 0, given_back = 0;
};

struct Pool {
  std::mutex lock;
  std::unordered_map<void*, Block*> in_use;             // pooled blocks handed out, by address
  std::unordered_map<size_t, std::vector<Block*>> idle;  // by size class, none empty
  size_t idle_bytes = 0;
  std::atomic<size_t> cap{0};
  Stats stats;
  c10::Allocator* torch_allocator = nullptr;             // the allocator stood in front of
  std::once_flag install_once;
  std::atomic<bool> installed{false};
  std::atomic<bool> refused{false};     // install() found it could not stand in front
};

// Never destroyed: a pooled tensor freed during interpreter exit still
// finds it.
inline Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

inline thread_local int scope_depth = 0;

// A block's size class: n rounded up to an eighth of its power of two, so
// that tensors of nearby sizes (another sequence length) share blocks, at
// most 12.5 % over the size asked for.
inline size_t size_class(size_t n) {
  size_t power = size_t(1) << (63 - __builtin_clzll(n));
  size_t step = power / 8;
  return (n + step - 1) / step * step;
}

// Give idle blocks back to torch's allocator until `room` more bytes fit
// under the cap; called with the lock held, the blocks freed by the caller
// after letting go of it (a free can take milliseconds: munmap).
inline void evict_for(Pool& p, size_t room, std::vector<Block*>& out) {
  while (p.idle_bytes + room > p.cap && !p.idle.empty()) {
    auto it = p.idle.begin();
    out.push_back(it->second.back());
    it->second.pop_back();
    p.idle_bytes -= it->first;
    p.stats.given_back++;
    if (it->second.empty())
      p.idle.erase(it);
  }
}

inline void free_blocks(std::vector<Block*>& blocks) {
  for (Block* b : blocks)
    delete b;
  blocks.clear();
}

// The deleter of a pooled block: back to the pool, or to torch's allocator
// where it is larger than the cap.  false if `data` was not a pooled block.
inline bool give_back(void* data) {
  Pool& p = pool();
  std::vector<Block*> freed;
  bool pooled = false;
  {
    std::lock_guard<std::mutex> guard(p.lock);
    auto it = p.in_use.find(data);
    if (it != p.in_use.end()) {
      pooled = true;
      Block* b = it->second;
      p.in_use.erase(it);
      if (b->size <= p.cap) {
        evict_for(p, b->size, freed);
        p.idle[b->size].push_back(b);
        p.idle_bytes += b->size;
        p.stats.returned++;
      } else {
        freed.push_back(b);
        p.stats.given_back++;
      }
    }
  }
  free_blocks(freed);
  return pooled;
}

inline void delete_pooled(void* data) { give_back(data); }

// raw_allocate's callers (oneDNN's scratch memory, through ideep) free with
// raw_deleter(): a pooled block or torch's own.
inline void delete_any(void* data) {
  if (!give_back(data))
    pool().torch_allocator->raw_deleter()(data);
}

// Idle blocks back to torch's allocator.
inline void empty() {
  Pool& p = pool();
  std::vector<Block*> freed;
  {
    std::lock_guard<std::mutex> guard(p.lock);
    for (auto& [cls, list] : p.idle) {
      freed.insert(freed.end(), list.begin(), list.end());
      p.stats.given_back += static_cast<int64_t>(list.size());
    }
    p.idle.clear();
    p.idle_bytes = 0;
  }
  free_blocks(freed);
}

// torch's allocator's block of n bytes.  Where it fails (out of memory),
// the pool's idle blocks are given back and it is asked once more: memory
// the pool keeps idle must not make an allocation fail that would succeed
// without the pool (eager's own included).
inline c10::DataPtr torch_allocate(size_t n) {
  Pool& p = pool();
  try {
    return p.torch_allocator->allocate(n);
  } catch (const c10::Error&) {
    {
      std::lock_guard<std::mutex> guard(p.lock);
      if (p.idle_bytes == 0)
        throw;
    }
    empty();
    return p.torch_allocator->allocate(n);
  }
}

struct PoolAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    Pool& p = pool();
    if (scope_depth == 0 || n < MIN_BYTES || p.cap.load(std::memory_order_relaxed) == 0)
      return torch_allocate(n);
    const size_t cls = size_class(n);
    Block* b = nullptr;
    {
      std::lock_guard<std::mutex> guard(p.lock);
      auto it = p.idle.find(cls);
      if (it != p.idle.end() && !it->second.empty()) {
        b = it->second.back();
        it->second.pop_back();
        if (it->second.empty())
          p.idle.erase(it);
        p.idle_bytes -= cls;
        p.stats.hits++;
      } else {
        p.stats.misses++;
      }
    }
    if (b == nullptr) {
      static std::atomic<size_t> next_colour{0};
      const size_t offset = next_colour.fetch_add(1, std::memory_order_relaxed) % COLOURS *
                            COLOUR_BYTES;
      b = new Block{torch_allocate(cls + offset), cls, nullptr};
      b->data = static_cast<char*>(b->memory.get()) + offset;
    }
    void* data = b->data;
    {
      std::lock_guard<std::mutex> guard(p.lock);
      p.in_use.emplace(data, b);
    }
    // context == data, as raw_allocate requires of every allocation
    return {data, data, &delete_pooled, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_any; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

// Stand in front of torch's CPU allocator, at the first scope with a cap
// set.  Not done where it cannot be: another allocator installed above
// torch's default priority, or one without a raw deleter (whose
// raw_allocate callers could not be served).
inline void install() {
  static PoolAllocator* mine = new PoolAllocator();
  Pool& p = pool();
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current->raw_deleter() == nullptr) {
    p.refused = true;
    return;
  }
  p.torch_allocator = current;
  c10::SetCPUAllocator(mine, /*priority=*/0);
  p.installed = c10::GetCPUAllocator() == mine;
  p.refused = !p.installed;
}

inline void enter_scope() {
  if (scope_depth++ == 0 && pool().cap.load(std::memory_order_relaxed) != 0)
    std::call_once(pool().install_once, install);
}

inline void exit_scope() { --scope_depth; }

inline bool installed() { return pool().installed.load(); }

inline bool refused() { return pool().refused.load(); }

inline void c_enter_scope() noexcept {
  try {
    enter_scope();
  } catch (...) {
    // (a failed install leaves torch's allocator in place: nothing pooled)
  }
}

inline void c_exit_scope() noexcept { exit_scope(); }

inline const fl_cpu_pool_scope scope_functions = {&c_enter_scope, &c_exit_scope};

inline void set_cap(size_t bytes) {
  Pool& p = pool();
  std::vector<Block*> freed;
  {
    std::lock_guard<std::mutex> guard(p.lock);
    p.cap = bytes;
    evict_for(p, 0, freed);
  }
  free_blocks(freed);
}

// hits, misses, blocks returned to the pool, blocks given back to torch's
// allocator, idle bytes, pooled blocks in use, the cap.
inline std::vector<int64_t> stats() {
  Pool& p = pool();
  std::lock_guard<std::mutex> guard(p.lock);
  return {p.stats.hits, p.stats.misses, p.stats.returned, p.stats.given_back,
          static_cast<int64_t>(p.idle_bytes), static_cast<int64_t>(p.in_use.size()),
          static_cast<int64_t>(p.cap.load())};
}

// In a forked child only the forking thread exists: a lock another thread
// held stays held.  The child starts with an unlocked one.
inline void after_fork() {
  new (&pool().lock) std::mutex();
}

}  // namespace fastlazy::cpu_pool
