// The suffix drafter's index (speculation/drafters/suffix.py) in C++: a torch class
// `specserve.SuffixTrie`, the same trie as the module's Python `SuffixTrie` and the same match and
// tree growth as `SuffixDrafter._speculate`, node for node (tests/test_drafters_lookup.py compares
// the two on random and repetitive sequences). The Python one costs ~1 us a token to index and
// ~100 us a request to match and grow; at batch 4 and 8 of the bundled model, where a drafted step
// gains little, that was what `auto` lost to plain decoding (BENCHMARKS.md, session 40).
//
//   SuffixTrie(depth)
//   extend(seq, tokens)                append `tokens` to sequence `seq` (0 .. num_seqs()-1) and index
//                                      every window of at most `depth` tokens they end; seq == -1
//                                      starts a new sequence. Returns the sequence's id.
//   close(seq)                         the sequence is complete: drop its open windows
//   remove(seq)                        undo the sequence's indexing (counts drop, empty nodes go)
//   tail(seq, n)                       its last n tokens (tests)
//   children(pattern)                  (tokens, counts) continuing `pattern`, first seen first (tests)
//   num_nodes()                        nodes in use, the root included (tests)
//   speculate(context, max_depth, budget, max_spec_factor, min_prob)
//       -> (tokens, parents, conditional, score): the longest suffix of `context` (at most
//          max_depth) with a continuation, and the tree grown from it; score < 0: no match.
//
// Nodes live in one vector (freed ones reused); a node's children are kept in first-seen order for
// listing and found through one hash map of (parent, token) edges. A node counting one occurrence
// is compressed: it keeps where that occurrence ends (sequence, position) instead of children.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace specserve {
namespace {

struct TrieNode {
    int64_t count = 0;
    int32_t seq = -1;  // compressed: the occurrence's sequence and last position
    int32_t end = -1;
    bool expanded = false;
    std::vector<std::pair<int32_t, int32_t>> kids;  // (token, node) in first-seen order
};

struct Cursor {
    int32_t node;  // >= 0: an expanded node; -1: inside a compressed path at (seq, end)
    int32_t seq;
    int32_t end;
};

struct Open {
    int32_t node;
    int32_t depth;
};

using Proposal = std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>, double>;

}  // namespace

struct SuffixTrie : torch::CustomClassHolder {
    int64_t depth;
    std::vector<TrieNode> nodes;
    std::vector<int32_t> free_nodes;
    std::unordered_map<uint64_t, int32_t> edges;
    std::vector<std::vector<int32_t>> seqs;
    std::vector<std::vector<Open>> windows;
    std::vector<int32_t> free_seqs;

    explicit SuffixTrie(int64_t depth) : depth(depth) {
        TORCH_CHECK(depth >= 1, "SuffixTrie: depth must be >= 1, got ", depth);
        nodes.emplace_back();
        nodes[0].expanded = true;  // the root
    }

    static uint64_t key(int32_t parent, int32_t tok) {
        return (uint64_t)(uint32_t)parent << 32 | (uint32_t)tok;
    }

    int32_t child(int32_t parent, int32_t tok) const {
        auto it = edges.find(key(parent, tok));
        return it == edges.end() ? -1 : it->second;
    }

    int32_t new_node(int32_t seq, int32_t end) {
        int32_t id;
        if (!free_nodes.empty()) {
            id = free_nodes.back();
            free_nodes.pop_back();
            nodes[id] = TrieNode();
        } else {
            id = (int32_t)nodes.size();
            nodes.emplace_back();
        }
        nodes[id].count = 1;
        nodes[id].seq = seq;
        nodes[id].end = end;
        return id;
    }

    int32_t add_child(int32_t parent, int32_t tok, int32_t seq, int32_t end) {
        int32_t id = new_node(seq, end);
        nodes[parent].kids.emplace_back(tok, id);
        edges.emplace(key(parent, tok), id);
        return id;
    }

    void expand(int32_t id, int64_t d) {
        int32_t seq = nodes[id].seq, end = nodes[id].end;
        nodes[id].expanded = true;
        nodes[id].seq = -1;
        const auto& s = seqs[seq];
        if (d < depth && (size_t)end + 1 < s.size()) add_child(id, s[end + 1], seq, end + 1);
    }

    // `SuffixTrie.push`: index token i of sequence `seq`, growing its open windows.
    void push(int32_t seq, int32_t i) {
        int32_t tok = seqs[seq][i];
        std::vector<Open>& open = windows[seq];
        std::vector<Open> still;
        still.reserve(open.size() + 1);
        open.push_back({0, 0});  // the window starting at i
        for (const Open& w : open) {
            int32_t c = child(w.node, tok);
            if (c < 0) {
                add_child(w.node, tok, seq, i);
                continue;
            }
            if (!nodes[c].expanded) expand(c, w.depth + 1);
            nodes[c].count += 1;
            if (w.depth + 1 < depth) still.push_back({c, w.depth + 1});
        }
        open.swap(still);
    }

    int64_t extend(int64_t seq, std::vector<int64_t> tokens) {
        if (seq < 0) {
            if (!free_seqs.empty()) {
                seq = free_seqs.back();
                free_seqs.pop_back();
            } else {
                seq = (int64_t)seqs.size();
                seqs.emplace_back();
                windows.emplace_back();
            }
        }
        TORCH_CHECK(seq < (int64_t)seqs.size(), "SuffixTrie.extend: no sequence ", seq);
        auto& s = seqs[seq];
        for (int64_t t : tokens) {
            s.push_back((int32_t)t);
            push((int32_t)seq, (int32_t)s.size() - 1);
        }
        return seq;
    }

    void close(int64_t seq) {
        TORCH_CHECK(seq >= 0 && seq < (int64_t)seqs.size(), "SuffixTrie.close: no sequence ", seq);
        std::vector<Open>().swap(windows[seq]);
    }

    void free_subtree(int32_t id) {
        for (const auto& [tok, c] : nodes[id].kids) {
            edges.erase(key(id, tok));
            free_subtree(c);
        }
        std::vector<std::pair<int32_t, int32_t>>().swap(nodes[id].kids);
        free_nodes.push_back(id);
    }

    // `SuffixTrie.remove`
    void remove(int64_t seq) {
        TORCH_CHECK(seq >= 0 && seq < (int64_t)seqs.size(), "SuffixTrie.remove: no sequence ", seq);
        const auto& s = seqs[seq];
        int64_t n = (int64_t)s.size();
        for (int64_t start = 0; start < n; ++start) {
            int32_t node = 0;
            for (int64_t k = 0; k < std::min(depth, n - start); ++k) {
                int32_t tok = s[start + k];
                int32_t c = child(node, tok);
                TORCH_CHECK(c >= 0, "SuffixTrie.remove: sequence ", seq, " was not indexed here");
                if (--nodes[c].count == 0) {
                    edges.erase(key(node, tok));
                    auto& kids = nodes[node].kids;
                    kids.erase(std::find(kids.begin(), kids.end(), std::make_pair(tok, c)));
                    free_subtree(c);
                    break;
                }
                if (!nodes[c].expanded) break;
                node = c;
            }
        }
        std::vector<int32_t>().swap(seqs[seq]);
        std::vector<Open>().swap(windows[seq]);
        free_seqs.push_back((int32_t)seq);
    }

    std::vector<int64_t> tail(int64_t seq, int64_t n) const {
        TORCH_CHECK(seq >= 0 && seq < (int64_t)seqs.size(), "SuffixTrie.tail: no sequence ", seq);
        const auto& s = seqs[seq];
        size_t from = s.size() - std::min(s.size(), (size_t)std::max<int64_t>(n, 0));
        return std::vector<int64_t>(s.begin() + from, s.end());
    }

    int64_t num_nodes() const { return (int64_t)(nodes.size() - free_nodes.size()); }

    // The continuations of `pattern` (tokens, counts) in first-seen order; none if it never occurred.
    std::tuple<std::vector<int64_t>, std::vector<int64_t>> children(std::vector<int64_t> pattern) const {
        std::tuple<std::vector<int64_t>, std::vector<int64_t>> out;
        Cursor cur{0, -1, -1};
        for (size_t k = 0; k < pattern.size(); ++k)
            if (!step(cur, (int64_t)k, (int32_t)pattern[k])) return out;
        if (cur.node >= 0) {
            for (const auto& [tok, c] : nodes[cur.node].kids) {
                std::get<0>(out).push_back(tok);
                std::get<1>(out).push_back(nodes[c].count);
            }
        } else if (continues(cur, (int64_t)pattern.size())) {
            std::get<0>(out).push_back(seqs[cur.seq][cur.end + 1]);
            std::get<1>(out).push_back(1);
        }
        return out;
    }

    // -- reading (`SuffixTrie.step`, `find`, `continues`, `frequent_children`) --------------------

    Cursor cursor(int32_t id) const {
        if (nodes[id].expanded) return {id, -1, -1};
        return {-1, nodes[id].seq, nodes[id].end};
    }

    bool step(Cursor& cur, int64_t d, int32_t tok) const {
        if (cur.node >= 0) {
            int32_t c = child(cur.node, tok);
            if (c < 0) return false;
            cur = cursor(c);
            return true;
        }
        const auto& s = seqs[cur.seq];
        if (d < depth && (size_t)cur.end + 1 < s.size() && s[cur.end + 1] == tok) {
            cur.end += 1;
            return true;
        }
        return false;
    }

    bool continues(const Cursor& cur, int64_t d) const {
        if (cur.node >= 0) return !nodes[cur.node].kids.empty();
        return d < depth && (size_t)cur.end + 1 < seqs[cur.seq].size();
    }

    struct Kid {
        int32_t tok;
        int64_t count;
        Cursor cur;
    };

    // The count of all continuations of `cur`, and those counting at least `share` of it, most
    // frequent first (first seen first among equals).
    int64_t frequent_children(const Cursor& cur, int64_t d, double share, std::vector<Kid>& out) const {
        out.clear();
        if (cur.node >= 0) {
            const auto& kids = nodes[cur.node].kids;
            int64_t total = 0;
            for (const auto& kc : kids) total += nodes[kc.second].count;
            double least = share * (double)total * (1 - 1e-9);
            for (const auto& [tok, c] : kids)
                if ((double)nodes[c].count >= least) out.push_back({tok, nodes[c].count, cursor(c)});
            std::stable_sort(out.begin(), out.end(), [](const Kid& a, const Kid& b) { return a.count > b.count; });
            return total;
        }
        const auto& s = seqs[cur.seq];
        if (d < depth && (size_t)cur.end + 1 < s.size()) {
            out.push_back({s[cur.end + 1], 1, {-1, cur.seq, cur.end + 1}});
            return 1;
        }
        return 0;
    }

    // -- `SuffixDrafter._speculate` and `_grow` ---------------------------------------------------

    Proposal speculate(std::vector<int64_t> context, int64_t max_depth, int64_t budget, double max_spec_factor,
                       double min_prob) const {
        int64_t n = (int64_t)context.size();
        int64_t lo = 0, hi = std::min(max_depth, n);
        bool found = false;
        Cursor match{0, -1, -1};
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            Cursor cur{0, -1, -1};
            bool ok = true;
            for (int64_t k = 0; k < mid && ok; ++k) ok = step(cur, k, (int32_t)context[n - mid + k]);
            if (ok && continues(cur, mid)) {
                lo = mid;
                match = cur;
                found = true;
            } else {
                hi = mid - 1;
            }
        }
        Proposal out;
        if (!found) {
            std::get<3>(out) = -1.0;
            return out;
        }
        int64_t max_spec = std::min(budget, std::max<int64_t>(1, (int64_t)((double)lo * max_spec_factor)));
        grow(match, lo, max_spec, min_prob, out);
        return out;
    }

    struct Entry {
        double p;
        int64_t order;
        int32_t tok;
        int64_t parent;
        Cursor cur;
        int64_t depth;
        double conditional;
        bool operator<(const Entry& o) const {  // the priority queue's top: highest p, first pushed among equals
            return p != o.p ? p < o.p : order > o.order;
        }
    };

    void grow(const Cursor& match, int64_t d, int64_t max_nodes, double min_prob, Proposal& out) const {
        auto& [tokens, parents, conditional, score] = out;
        std::priority_queue<Entry> heap;
        std::vector<Kid> kids;
        int64_t order = 0;
        auto push = [&](const Cursor& cur, int64_t cd, int64_t parent, double prob) {
            int64_t total = frequent_children(cur, cd, min_prob / prob, kids);
            for (const Kid& k : kids) {
                double p = prob * (double)k.count / (double)total;
                if (p >= min_prob) heap.push({p, order++, k.tok, parent, k.cur, cd + 1, (double)k.count / (double)total});
            }
        };
        push(match, d, -1, 1.0);
        score = 0.0;
        while (!heap.empty() && (int64_t)tokens.size() < max_nodes) {
            Entry e = heap.top();
            heap.pop();
            tokens.push_back(e.tok);
            parents.push_back(e.parent);
            conditional.push_back(e.conditional);
            score += e.p;
            push(e.cur, e.depth, (int64_t)tokens.size() - 1, e.p);
        }
    }
};

}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve, m) {
    m.class_<specserve::SuffixTrie>("SuffixTrie")
        .def(torch::init<int64_t>())
        .def("extend", &specserve::SuffixTrie::extend)
        .def("close", &specserve::SuffixTrie::close)
        .def("remove", &specserve::SuffixTrie::remove)
        .def("tail", &specserve::SuffixTrie::tail)
        .def("num_nodes", &specserve::SuffixTrie::num_nodes)
        .def("children", &specserve::SuffixTrie::children)
        .def("speculate", &specserve::SuffixTrie::speculate);
}
