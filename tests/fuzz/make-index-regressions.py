#!/usr/bin/env python3
"""Writes tests/fuzz/regressions/checkpoint_index/ from the seed index.json (docs/design.md section 17).

Each file is the real index of checkpoint_index_fuzz's saved checkpoint with one field made
hostile. Usage: tests/fuzz/make-index-regressions.py   (reads corpus/checkpoint_index/index.json)
"""
import copy
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
seed = json.load(open(os.path.join(here, 'corpus', 'checkpoint_index', 'index.json')))
out = os.path.join(here, 'regressions', 'checkpoint_index')
os.makedirs(out, exist_ok=True)
INT64_MAX = 2**63 - 1
first_key = sorted(seed['keys'])[0]
two_d = next(k for k in sorted(seed['keys']) if len(seed['keys'][k]['shape']) == 2)


def write(name, edit):
    j = copy.deepcopy(seed)
    edit(j)
    with open(os.path.join(out, name + '.json'), 'w') as f:
        json.dump(j, f, indent=1)


def chunk(j, key=first_key, i=0):
    return j['keys'][key]['chunks'][i]


def set_chunk_files(j, name):
    for k in j['keys'].values():
        for c in k['chunks']:
            if c['file'] == 'rank_00000.h5':
                c['file'] = name


def set_rank_file(j, name):
    j['files'][0]['name'] = name
    set_chunk_files(j, name)


# Chunk and rank file names that leave the checkpoint directory (../x is a real copy of
# rank_00000.h5 in the fuzz target's work folder, so only a name check rejects it).
write('chunk_file_parent', lambda j: set_chunk_files(j, '../x'))
write('rank_file_parent', lambda j: set_rank_file(j, '../x'))
write('chunk_file_absolute', lambda j: set_chunk_files(j, '/etc/hostname'))
write('rank_file_absolute', lambda j: set_rank_file(j, '/etc/hostname'))
write('chunk_file_subdir', lambda j: set_chunk_files(j, 'sub/rank_00000.h5'))
# Mesh sizes that are not the integers they look like.
write('mesh_dp_shard_fraction', lambda j: j['mesh'].update(dp_shard=1.5))
write('mesh_tp_wraps_int32', lambda j: j['mesh'].update(tp=4294967298))
write('mesh_tp_negative', lambda j: j['mesh'].update(tp=-2))
# Checksums stoull would half-read.
write('hash_0x_prefix', lambda j: chunk(j).update(xxh64='0x' + chunk(j)['xxh64'][2:]))
write('hash_trailing_junk', lambda j: chunk(j).update(xxh64=chunk(j)['xxh64'] + 'zz'))
write('hash_negative', lambda j: chunk(j).update(xxh64='-1'))
write('hash_too_long', lambda j: chunk(j).update(xxh64='1' + chunk(j)['xxh64']))


# Shapes, offsets and extents near INT64_MAX (overflow in offset + extent or in the numel).
def huge_shape(j):
    j['keys'][two_d]['shape'] = [INT64_MAX, INT64_MAX]


def huge_offset(j):
    c = chunk(j, two_d)
    c['offset'] = [INT64_MAX - 1, 0]


def huge_extent(j):
    c = chunk(j, two_d)
    c['extent'] = [INT64_MAX, c['extent'][1]]


def huge_offset_and_extent(j):
    k = j['keys'][two_d]
    k['shape'] = [INT64_MAX, k['shape'][1]]
    c = k['chunks'][0]
    c['offset'] = [INT64_MAX - 2, 0]
    c['extent'] = [INT64_MAX - 2, c['extent'][1]]


def huge_numel(j):
    k = j['keys'][two_d]
    k['shape'] = [2**32, 2**32]
    for c in k['chunks']:
        c['extent'] = [2**32, 2**32]
        c['offset'] = [0, 0]
    k['chunks'] = k['chunks'][:1]


write('shape_int64_max', huge_shape)
write('offset_int64_max', huge_offset)
write('extent_int64_max', huge_extent)
write('offset_plus_extent_overflow', huge_offset_and_extent)
write('numel_overflows', huge_numel)
print('wrote', len(os.listdir(out)), 'files to', out)
