// Cache addressing of SPEC §3: the page map inside a (page, slot) tile and the
// 64-bit page offsets of 4-D, LBHNC and BLHNC caches. Host/device-safe.
#pragma once

#include "m3sparse/common.h"

namespace m3sparse {

// `layout` attribute of every FFI target (SPEC §3.3). A 4-D cache is one layer.
enum Layout : int64_t { kLBHNC = 0, kBLHNC = 1 };

struct CacheGeometry {
  int64_t num_pages;    // P
  int64_t num_layers;   // L (1 for a 4-D cache)
  int64_t num_slots;    // 2·Hkv: slot 2h = K of KV head h, slot 2h+1 = V (SPEC §3.1)
  int64_t block_size;   // N tokens per page
  int64_t head_dim;     // D
  int64_t layout;       // Layout

  M3_HD int64_t full_dim() const { return head_dim / 2 + head_dim / 16; }
  M3_HD int64_t tile_bytes() const { return block_size * full_dim(); }
  M3_HD int64_t page_bytes() const { return num_slots * tile_bytes(); }
  M3_HD int64_t data_bytes() const { return head_dim / 2; }     // per token
  M3_HD int64_t scale_bytes() const { return head_dim / 16; }   // per token
  M3_HD int64_t total_bytes() const { return num_layers * num_pages * page_bytes(); }

  M3_HD bool valid_layer(int64_t layer) const { return layer >= 0 && layer < num_layers; }
  M3_HD bool valid_page(int64_t page) const { return page >= 0 && page < num_pages; }

  // Byte offset of page `page` of layer `layer`; both must be valid.
  M3_HD int64_t page_offset(int64_t layer, int64_t page) const {
    int64_t index = layout == kBLHNC ? page * num_layers + layer : layer * num_pages + page;
    return index * page_bytes();
  }
  M3_HD int64_t tile_offset(int64_t layer, int64_t page, int64_t slot) const {
    return page_offset(layer, page) + slot * tile_bytes();
  }
  // Inside a tile (SPEC §3.2): the data plane, then the scale plane.
  M3_HD int64_t token_data_offset(int64_t t) const { return t * data_bytes(); }
  M3_HD int64_t token_scale_offset(int64_t t) const {
    return block_size * data_bytes() + t * scale_bytes();
  }
};

}  // namespace m3sparse
