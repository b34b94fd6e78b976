// Collective checkpoint save and load (engine/checkpoint/checkpoint.h): state assembly, the ranks'
// agreement per phase, the atomic commit, resharding loads. The index format, the rank files and
// verify are in checkpoint_index.cc, checkpoint_files.cc and checkpoint_verify.cc
// (engine/checkpoint/checkpoint_files.h).
#include "engine/checkpoint/checkpoint.h"

#include <H5Cpp.h>
#include <fcntl.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include "engine/checkpoint/checkpoint_files.h"
#include "engine/faults/fault_hooks.h"
#include "engine/parallel/mesh_groups.h"
#include "kernels/core/build_info.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "kernels/core/hdf5_check.h"
#include "kernels/core/runtime.h"
#include "mesh/core/agreement.h"

namespace meshproof::engine {
using namespace ckpt_detail;  // NOLINT(google-build-using-namespace): the module's helpers

namespace {

// Agreement step of a collective save/load phase over every rank (mesh/core/agreement.h): when any
// rank's phase failed, every rank throws, so no rank moves on alone and every process can tell the
// user the cause ("checkpoint save (commit) failed on rank 3: ...").
void agree(mesh::RankComms& comms, std::exception_ptr error, std::string_view phase) {
  mesh::agree_on_outcome(comms.group(groups::all_ranks(comms.mesh())), std::move(error),
                         fmt::format("checkpoint {}", phase));
}

// A random checkpoint id from rank 0, the same on every rank.
uint64_t agree_checkpoint_id(mesh::RankComms& comms) {
  mesh::Communicator& world = comms.group(groups::all_ranks(comms.mesh()));
  uint64_t id = 0;
  if (world.rank() == 0) {
    std::random_device rd;
    id = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  }
  Tensor buf = Tensor::zeros(Shape{8}, DType::kUInt8, kernels::Device::cpu());
  std::memcpy(buf.raw_data(), &id, 8);
  const kernels::Device device = kernels::current_context().device;
  buf = buf.on(device);
  world.broadcast(buf, 0);
  const std::vector<uint8_t> bytes = buf.to_vector<uint8_t>();
  std::memcpy(&id, bytes.data(), 8);
  return id;
}

void check_live_state(const ShardedState& state, const mesh::RankComms& comms) {
  std::set<std::string> seen;
  for (const StateEntry& e : state.entries) {
    MP_CHECK_INPUT(valid_key(e.key),
                   "checkpoint: state key '{}' is not a checkpoint key (path components of "
                   "[A-Za-z0-9._+-] separated by '/', none '.' or '..')",
                   e.key);
    MP_CHECK_INPUT(seen.insert(e.key).second, "checkpoint: key '{}' appears twice in the state",
                   e.key);
    MP_CHECK_INPUT(e.layout.mesh() == comms.mesh(),
                   "checkpoint key '{}': layout mesh {} differs from the run's mesh {}", e.key,
                   e.layout.mesh().str(), comms.mesh().str());
    MP_CHECK_INPUT(e.local.defined() && e.local.shape() == e.layout.local_shape(comms.rank()),
                   "checkpoint key '{}': local tensor {} does not match its layout box {} on "
                   "rank {}",
                   e.key, e.local.defined() ? e.local.describe() : std::string("(undefined)"),
                   e.layout.box(comms.rank()).str(), comms.rank());
    element_bytes(e.local.dtype(), e.key);
  }
  for (const auto& [name, v] : state.scalars) {
    MP_CHECK_INPUT(valid_key(name), "checkpoint: scalar name '{}' is not a checkpoint key", name);
    MP_CHECK_INPUT(v >= 0,
                   "checkpoint: scalar '{}' is {}; scalars are counters and positions (>= 0)", name,
                   v);
  }
}

}  // namespace

std::string_view save_point_name(SavePoint p) {
  switch (p) {
    case SavePoint::kDatasetWritten:
      return "dataset_written";
    case SavePoint::kRankFileWritten:
      return "rank_file_written";
    case SavePoint::kBeforeIndex:
      return "before_index";
    case SavePoint::kBeforeRename:
      return "before_rename";
  }
  return "?";
}

std::string checkpoint_dir_name(int64_t step) { return fmt::format("step_{:07d}", step); }

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (!fs::is_directory(root)) return {};
  static const std::regex re("step_([0-9]{7,18})");
  for (const auto& d : fs::directory_iterator(root)) {
    std::smatch m;
    const std::string name = d.path().filename().string();
    if (d.is_directory() && std::regex_match(name, m, re) && fs::exists(d.path() / kIndexName)) {
      found.emplace_back(std::stoll(m[1].str()), d.path());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [s, p] : found) out.push_back(p);
  return out;
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

fs::path save_checkpoint(const fs::path& root, int64_t step, const ShardedState& state,
                         mesh::RankComms& comms, const CheckpointOptions& options) {
  const int rank = comms.rank();
  const int world = comms.mesh().world_size();
  const fs::path final_dir = root / checkpoint_dir_name(step);
  const fs::path partial = root / (checkpoint_dir_name(step) + kPartialSuffix);
  // Checkpoint-side faults act through the checkpoint_save point (engine/faults/fault_hooks.h).
  const FaultHooks faults = make_fault_hooks(options.faults);

  // Phase 1 (rank 0): prepare the partial directory; stale partial directories are removed.
  agree(comms, mesh::capture_error([&] {
          MP_CHECK_INPUT(step >= 0, "checkpoint step {} is negative", step);
          MP_CHECK_INPUT(world <= kMaxWorld, "checkpoint: a mesh of {} ranks (at most {})", world,
                         kMaxWorld);
          check_live_state(state, comms);
          const bool printable =
              std::all_of(options.scenario_hash.begin(), options.scenario_hash.end(),
                          [](char c) { return c >= 0x20 && c < 0x7f; });
          MP_CHECK_INPUT(printable && options.scenario_hash.size() <= 256,
                         "checkpoint: scenario hash '{}' is not printable ASCII of at most 256 "
                         "characters",
                         options.scenario_hash);
          if (rank != 0) return;
          std::error_code ec;
          fs::create_directories(root, ec);
          MP_CHECK(!ec, "cannot create checkpoint root {}: {}", root.string(), ec.message());
          MP_CHECK_INPUT(!fs::exists(final_dir),
                         "checkpoint {} already exists; a complete checkpoint is never "
                         "overwritten",
                         final_dir.string());
          // Only meshproof's own leftovers (step_NNNNNNN.partial of a killed save) are removed;
          // any other folder in the root is not ours to touch.
          static const std::regex stale_partial("step_[0-9]{7,18}\\.partial");
          for (const auto& d : fs::directory_iterator(root)) {
            if (d.is_directory() && !d.is_symlink() &&
                std::regex_match(d.path().filename().string(), stale_partial)) {
              fs::remove_all(d.path(), ec);
              MP_CHECK(!ec, "cannot remove stale {}: {}", d.path().string(), ec.message());
            }
          }
          fs::create_directory(partial, ec);
          MP_CHECK(!ec, "cannot create {}: {}", partial.string(), ec.message());
        }),
        "save (prepare)");
  const uint64_t checkpoint_id = agree_checkpoint_id(comms);

  // From here on the save owns `partial`: when any rank fails, rank 0 removes it after the
  // agreement (no rank writes into it any more), so a failed save leaves nothing behind.
  auto remove_partial_on_failure = [&](auto&& phase) {
    try {
      phase();
    } catch (...) {
      if (rank == 0) {
        std::error_code ec;
        fs::remove_all(partial, ec);
      }
      throw;
    }
  };

  // Phase 2 (every rank): write the chunks this rank is the designated writer of, then a sidecar
  // with their records for rank 0.
  remove_partial_on_failure([&] {
    agree(
        comms, mesh::capture_error([&] {
          const std::string file_name = rank_file_name(rank);
          const fs::path file_path = partial / file_name;
          // Layouts place tensors over the stage dims: their chunk owners are ranks of stage 0,
          // and this rank writes the chunks its place in its stage owns (its stage's entries only;
          // with one stage, its own rank).
          const int in_stage = rank - comms.mesh().stage(rank) * comms.mesh().stage_size();
          json records = json::array();
          std::vector<std::pair<std::string, Tensor>> to_write;  // dataset, host data
          // The entries this rank writes, downloaded from a device in one batched transfer
          // (kernels::to_host_batched; host entries are used as they are).
          std::vector<Tensor> written;
          // A replica (a key another stage saves: StateEntry::replica) is not written.
          const auto saves = [&](const StateEntry& e) {
            return !e.replica && faults.checkpoint_keeps(e.key, step);
          };
          for (const StateEntry& e : state.entries) {
            bool owns = false;
            for (const mesh::Chunk& c : e.layout.chunks()) owns = owns || c.owner == in_stage;
            written.push_back(owns && saves(e) ? e.local : Tensor());
          }
          written = kernels::to_host_batched(written);
          for (size_t ei = 0; ei < state.entries.size(); ++ei) {
            const StateEntry& e = state.entries[ei];
            if (!saves(e)) continue;
            for (const mesh::Chunk& c : e.layout.chunks()) {
              if (c.owner != in_stage) continue;
              const Tensor host = faults.checkpoint_bytes(e.key, step, written[ei]);
              const std::string dataset = "/" + e.key;
              records.push_back({{"key", e.key},
                                 {"dataset", dataset},
                                 {"offset", elems(c.box.offset)},
                                 {"extent", elems(c.box.extent)},
                                 {"xxh64", hash_hex(chunk_xxh64(checkpoint_id, e.key, host.dtype(),
                                                                c.box, host))}});
              to_write.emplace_back(dataset, host);
            }
          }
          std::string image;  // the rank file's bytes
          {
            std::lock_guard<std::mutex> lock(hdf5_mutex());
            kernels::silence_hdf5_errors();
            // The rank file is built in memory (HDF5's core driver, no backing store) and
            // written with write_text_file: HDF5 1.10 never touches the disk, so a full disk
            // fails in our write with errno's reason. (On the sec2 driver an ENOSPC inside
            // H5Fclose leaves the library with a half-closed file that crashes the process at
            // exit.) Costs one in-memory copy of this rank's chunks during the save.
            int64_t data_bytes = 0;
            for (const auto& [dataset, host] : to_write) data_bytes += host.nbytes().value;
            H5::FileAccPropList fapl;
            fapl.setCore(static_cast<size_t>(data_bytes) + (size_t{1} << 16), false);
            H5::H5File f = MP_HDF5(
                kRuntime,
                H5::H5File(file_path.string(), H5F_ACC_TRUNC, H5::FileCreatPropList::DEFAULT, fapl),
                "creating checkpoint rank file {} in memory", file_path.string());
            auto write_id = [&] {
              const std::string id = hash_hex(checkpoint_id);
              H5::StrType t(H5::PredType::C_S1, id.size());
              f.createAttribute("checkpoint_id", t, H5::DataSpace(H5S_SCALAR)).write(t, id);
              return 0;
            };
            MP_HDF5(kRuntime, write_id(), "writing the checkpoint id to rank file {}",
                    file_path.string());
            H5::LinkCreatPropList lcpl;
            lcpl.setCreateIntermediateGroup(true);
            for (size_t i = 0; i < to_write.size(); ++i) {
              // References, not a structured binding: clang before 16 cannot capture a binding in
              // the lambda below, and the sanitizer/fuzz build (design.md section 17) is clang 14.
              const std::string& dataset = to_write[i].first;
              const Tensor& host = to_write[i].second;
              const json& rec = records[i];
              const std::string key = rec.at("key").get<std::string>();
              auto write_dataset = [&] {
                H5::DataSet ds = f.createDataSet(
                    dataset, storage_type(host.dtype(), key), dataspace_for(host.shape()),
                    H5::DSetCreatPropList::DEFAULT, H5::DSetAccPropList::DEFAULT, lcpl);
                if (host.numel().value > 0) {
                  ds.write(host.raw_data(), storage_type(host.dtype(), key));
                }
                const std::string dt(kernels::dtype_name(host.dtype()));
                H5::StrType str_type(H5::PredType::C_S1, dt.size());
                ds.createAttribute("dtype", str_type, H5::DataSpace(H5S_SCALAR))
                    .write(str_type, dt);
                H5::StrType key_type(H5::PredType::C_S1, key.size());
                ds.createAttribute("key", key_type, H5::DataSpace(H5S_SCALAR)).write(key_type, key);
                const std::vector<int64_t> off = rec.at("offset").get<std::vector<int64_t>>();
                const hsize_t n = off.size();
                if (n > 0) {
                  ds.createAttribute("global_offset", H5::PredType::NATIVE_INT64,
                                     H5::DataSpace(1, &n))
                      .write(H5::PredType::NATIVE_INT64, off.data());
                }
                return 0;
              };
              MP_HDF5(kRuntime, write_dataset(), "writing dataset {} to checkpoint rank file {}",
                      dataset, file_path.string());
              if (options.fault_hook) {
                options.fault_hook(SavePoint::kDatasetWritten, rank, static_cast<int64_t>(i));
              }
            }
            auto image_of = [&] {
              f.flush(H5F_SCOPE_LOCAL);
              const ssize_t n = H5Fget_file_image(f.getId(), nullptr, 0);
              if (n < 0) throw H5::FileIException("H5Fget_file_image", "no file image");
              std::string bytes(static_cast<size_t>(n), '\0');
              if (H5Fget_file_image(f.getId(), bytes.data(), bytes.size()) != n) {
                throw H5::FileIException("H5Fget_file_image", "short file image");
              }
              f.close();
              return bytes;
            };
            image = MP_HDF5(kRuntime, image_of(), "building checkpoint rank file {}",
                            file_path.string());
          }
          write_text_file(file_path, image);
          image.clear();
          image.shrink_to_fit();
          fsync_path(file_path);
          json side = {{"rank", rank}, {"file", file_name}, {"chunks", records}};
          side["keys"] = json::array();
          for (const StateEntry& e : state.entries)
            if (!e.replica) side["keys"].push_back(e.key);
          // What the index records of each saved key (rank 0 holds only its own stage's).
          side["records"] = json::array();
          for (const StateEntry& e : state.entries) {
            if (!saves(e)) continue;
            json placements = json::array();
            for (const mesh::Placement& p : e.layout.placements())
              placements.push_back(placement_json(p));
            side["records"].push_back({{"key", e.key},
                                       {"shape", e.layout.global_shape().dims()},
                                       {"dtype", kernels::dtype_name(e.local.dtype())},
                                       {"placements", placements}});
          }
          side["scalars"] = state.scalars;
          write_text_file(partial / sidecar_name(rank), side.dump());
          if (options.fault_hook) options.fault_hook(SavePoint::kRankFileWritten, rank, -1);
        }),
        "save (rank files)");
  });

  // Phase 3 (rank 0): assemble and write the index last, then commit by renaming.
  remove_partial_on_failure([&] {
    agree(comms, mesh::capture_error([&] {
            if (rank != 0) return;
            CheckpointIndex index;
            index.checkpoint_id = checkpoint_id;
            index.step = step;
            index.mesh = comms.mesh();
            index.scenario_hash = options.scenario_hash;
            index.model = options.model;
            index.meshproof_version = std::string(kernels::version());
            index.git_commit = std::string(kernels::git_commit());
            index.scalars = state.scalars;
            // Every rank of a stage holds the same keys; with pipeline stages each stage holds
            // its own (docs/design.md section 33), and a key is written by exactly one stage: the
            // index is the union, each key described by its stage's first rank.
            const mesh::DeviceMesh& m = comms.mesh();
            std::vector<std::string> stage_keys;  // the keys of the stage being read
            std::map<std::string, int> key_stage;
            for (int r = 0; r < world; ++r) {
              const json side = read_json_file(partial / sidecar_name(r), "checkpoint sidecar");
              const std::vector<std::string> names =
                  side.at("keys").get<std::vector<std::string>>();
              const int stage = m.stage(r);
              const int first = stage * m.stage_size();
              if (r == first) {
                stage_keys = names;
                for (const std::string& name : names) {
                  const auto [it, fresh] = key_stage.emplace(name, stage);
                  MP_CHECK_INPUT(fresh,
                                 "checkpoint save: key '{}' is held by pipeline stages {} and "
                                 "{}; each key must be held (and written) by one stage",
                                 name, it->second, stage);
                }
                for (const json& rj : side.at("records")) {
                  KeyRecord k;
                  k.key = rj.at("key").get<std::string>();
                  k.shape = Shape(rj.at("shape").get<std::vector<int64_t>>());
                  k.dtype = kernels::parse_dtype(rj.at("dtype").get<std::string>(),
                                                 "checkpoint sidecar dtype");
                  for (const json& pj : rj.at("placements"))
                    k.placements.push_back(
                        placement_from_json(pj, "checkpoint sidecar", k.key, k.shape.rank()));
                  index.keys.emplace(k.key, std::move(k));
                }
              }
              MP_CHECK(names == stage_keys,
                       "checkpoint save: rank {} saved keys that differ from "
                       "rank {}'s",
                       r, first);
              using ScalarMap = std::map<std::string, int64_t>;
              MP_CHECK(side.at("scalars").get<ScalarMap>() == state.scalars,
                       "checkpoint save: rank {} has scalars that differ from rank 0's", r);
              for (const json& c : side.at("chunks")) {
                const std::string key = c.at("key").get<std::string>();
                ChunkRecord rec;
                rec.file = side.at("file").get<std::string>();
                rec.dataset = c.at("dataset").get<std::string>();
                rec.box.offset = to_elems(c.at("offset").get<std::vector<int64_t>>());
                rec.box.extent = to_elems(c.at("extent").get<std::vector<int64_t>>());
                rec.xxh64 = std::stoull(c.at("xxh64").get<std::string>(), nullptr, 16);
                index.keys.at(key).chunks.push_back(std::move(rec));
              }
              index.files.push_back(rank_file_name(r));
              index.file_bytes.push_back(
                  static_cast<int64_t>(fs::file_size(partial / rank_file_name(r))));
            }
            const std::string text = index_json_text(index);
            // The saver never writes an index its own reader rejects (chunks equal to the
            // layouts' chunks, file names, ranges).
            parse_checkpoint_index(text, "checkpoint save: the index being written");
            if (options.fault_hook) options.fault_hook(SavePoint::kBeforeIndex, rank, -1);
            write_text_file(partial / kIndexName, text);
            for (int r = 0; r < world; ++r) fs::remove(partial / sidecar_name(r));
            fsync_path(partial);
            if (options.fault_hook) options.fault_hook(SavePoint::kBeforeRename, rank, -1);
            std::error_code ec;
            fs::rename(partial, final_dir, ec);
            MP_CHECK(!ec, "renaming {} to {}: {}", partial.string(), final_dir.string(),
                     ec.message());
            fsync_path(root);
            if (options.keep_last > 0) {
              auto all = list_checkpoints(root);
              for (size_t i = 0; i + static_cast<size_t>(options.keep_last) < all.size(); ++i) {
                fs::remove_all(all[i], ec);
                MP_CHECK(!ec, "removing old checkpoint {}: {}", all[i].string(), ec.message());
              }
              fsync_path(root);
            }
          }),
          "save (commit)");
  });
  return final_dir;
}

LoadStats load_checkpoint(const fs::path& dir, ShardedState& state, mesh::RankComms& comms,
                          const CheckpointOptions& options) {
  const int rank = comms.rank();
  LoadStats stats;
  CheckpointIndex index;
  std::vector<Tensor> staged(state.entries.size());  // undefined: keep the live tensor
  std::map<std::string, int64_t> staged_scalars;
  std::optional<FileCache> cache;
  // Whether the live mesh has pipeline stages, whose ranks hold only their stage's entries.
  const bool staged_pp = comms.mesh().size(mesh::MeshDim::kPp) > 1;

  // Stage everything: read, verify and assemble into buffers; the live state is untouched.
  std::exception_ptr error = mesh::capture_error([&] {
    check_live_state(state, comms);
    {
      std::lock_guard<std::mutex> lock(hdf5_mutex());
      kernels::silence_hdf5_errors();
    }
    index = read_checkpoint_index(dir);
    cache.emplace(dir, index.checkpoint_id);
    // Load-side faults act through the checkpoint_restore point; a key the checkpoint_save point
    // leaves out of a checkpoint of this step may be missing (engine/faults/fault_hooks.h).
    const FaultHooks faults = make_fault_hooks(options.faults);
    std::set<std::string> live_keys;
    for (size_t i = 0; i < state.entries.size(); ++i) {
      const StateEntry& e = state.entries[i];
      live_keys.insert(e.key);
      auto it = index.keys.find(e.key);
      if (it == index.keys.end()) {
        MP_CHECK_INPUT(!faults.checkpoint_keeps(e.key, index.step),
                       "checkpoint {}: key '{}' of the live state is missing from the checkpoint",
                       dir.string(), e.key);
        continue;  // the fault dropped it: the live value stays
      }
      const KeyRecord& k = it->second;
      MP_CHECK_INPUT(k.shape == e.layout.global_shape(),
                     "checkpoint {}: key '{}' has global shape {}, the live state {}", dir.string(),
                     e.key, k.shape.str(), e.layout.global_shape().str());
      MP_CHECK_INPUT(k.dtype == e.local.dtype(),
                     "checkpoint {}: key '{}' has dtype {}, the live state {}", dir.string(), e.key,
                     kernels::dtype_name(k.dtype), kernels::dtype_name(e.local.dtype()));
      // The layout's box (the load_box fault point may move it, engine/faults/fault_hooks.h).
      const mesh::Box target = faults.load_box(e.key, e.layout, rank, index.step);
      Tensor buf = Tensor::empty(target.shape(), k.dtype, kernels::Device::cpu());
      int64_t covered = 0;
      for (const ChunkRecord& c : k.chunks) {
        const mesh::Box region = c.box.intersect(target);
        if (region.empty()) continue;
        // Verified even when a load-side fault leaves the key unrestored below.
        Tensor chunk = read_chunk_cached(*cache, index, k, c);
        ++stats.chunks_read;
        stats.bytes_read += chunk.nbytes();
        mesh::copy_region(chunk, c.box, buf, target, region);
        covered += region.numel().value;
      }
      MP_CHECK(covered == target.numel().value,
               "checkpoint {}: key '{}' chunks cover {} of rank {}'s {} elements", dir.string(),
               e.key, covered, rank, target.numel().value);
      if (faults.restores(e.key, index.step)) staged[i] = buf;
    }
    // With pipeline stages this rank holds only its stage's keys: the stages' union is checked
    // after the agreement below.
    if (!staged_pp) {
      for (const auto& [name, k] : index.keys) {
        MP_CHECK_INPUT(live_keys.count(name) > 0,
                       "checkpoint {}: key '{}' has no tensor in the live state (a different "
                       "model or recipe?)",
                       dir.string(), name);
      }
    }
    for (const auto& [name, v] : state.scalars) {
      auto it = index.scalars.find(name);
      MP_CHECK_INPUT(it != index.scalars.end(),
                     "checkpoint {}: scalar '{}' of the live state is missing from the checkpoint",
                     dir.string(), name);
      if (faults.restores(name, index.step))
        staged_scalars[name] = faults.restored_scalar(name, index.step, it->second);
    }
    for (const auto& [name, v] : index.scalars) {
      MP_CHECK_INPUT(state.scalars.count(name) > 0,
                     "checkpoint {}: scalar '{}' has no counterpart in the live state",
                     dir.string(), name);
    }
  });
  if (cache) stats.files_opened = cache->names();
  cache.reset();
  agree(comms, error, "load");
  if (staged_pp) {
    // Every key of the checkpoint must have its tensor on exactly one stage of the live mesh
    // (docs/design.md section 33): each rank marks the keys it holds, the marks are summed over
    // the pp group (one rank of every stage at the same place; the ranks of a stage hold the
    // same keys) and every sum must be 1. A replica (the last stage's copy of a tied embed.tok,
    // StateEntry::replica) is filled from the same key but not counted: the stage that saves
    // the key holds it.
    std::vector<std::string> names;
    for (const auto& [name, k] : index.keys) names.push_back(name);
    std::set<std::string> live_keys;
    for (const StateEntry& e : state.entries)
      if (!e.replica) live_keys.insert(e.key);
    std::vector<float> mine(names.size() + 1, 0.0f);  // + 1: never an empty buffer
    for (size_t i = 0; i < names.size(); ++i) mine[i] = live_keys.count(names[i]) ? 1.0f : 0.0f;
    Tensor held = Tensor::from_vector<float>(Shape{static_cast<int64_t>(mine.size())}, mine);
    const kernels::Device device = kernels::current_context().device;
    held = held.on(device);
    comms.group(groups::kPp).all_reduce(held, mesh::ReduceOp::kSum);
    const std::vector<float> stages = held.to_vector<float>();
    agree(comms, mesh::capture_error([&] {
            for (size_t i = 0; i < names.size(); ++i) {
              MP_CHECK_INPUT(stages[i] != 0.0f,
                             "checkpoint {}: key '{}' has no tensor in the live state of any "
                             "pipeline stage (a different model or recipe?)",
                             dir.string(), names[i]);
              MP_CHECK_INPUT(stages[i] == 1.0f,
                             "checkpoint {}: key '{}' is held by {} pipeline stages of the live "
                             "state; each key must be held by one",
                             dir.string(), names[i], static_cast<int>(stages[i]));
            }
          }),
          "load");
  }

  // Commit: every rank staged everything. A device-resident state is uploaded in one batched
  // transfer (kernels::copy_batched).
  std::vector<Tensor*> dsts;
  std::vector<Tensor> srcs;
  for (size_t i = 0; i < state.entries.size(); ++i) {
    if (staged[i].defined() && staged[i].numel().value > 0) {
      dsts.push_back(&state.entries[i].local);
      srcs.push_back(staged[i]);
    }
  }
  kernels::copy_batched(dsts, srcs);
  for (const auto& [name, v] : staged_scalars) state.scalars[name] = v;
  return stats;
}

}  // namespace meshproof::engine
