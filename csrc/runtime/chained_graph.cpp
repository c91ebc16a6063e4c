// The chained graph (chained_graph.h): the pieces of a split graph run in order over one table of slots.
#include "runtime/chained_graph.h"

#include <algorithm>
#include <string>

#include "common/error.h"

namespace kiln::runtime {

namespace {

class ChainedGraph final : public CompiledGraph {
 public:
  ChainedGraph(std::vector<ChainLink> links, size_t num_inputs, std::vector<int32_t> output_slots)
      : links_(std::move(links)), num_inputs_(num_inputs), output_slots_(std::move(output_slots)) {
    num_slots_ = num_inputs_;
    for (const ChainLink& link : links_) num_slots_ += link.num_outputs;
    // Per link, the slots made by a link that no later link and no output reads: released once it has run.
    std::vector<int64_t> last_reader(num_slots_, -1);
    for (size_t i = 0; i < links_.size(); ++i)
      for (int32_t slot : links_[i].input_slots) {
        KILN_ASSERT(slot >= 0 && static_cast<size_t>(slot) < num_slots_) << "chain link " << i << " reads slot " << slot;
        last_reader[slot] = static_cast<int64_t>(i);
      }
    for (int32_t slot : output_slots_) {
      KILN_ASSERT(slot >= 0 && static_cast<size_t>(slot) < num_slots_) << "chain output slot " << slot;
      last_reader[slot] = static_cast<int64_t>(links_.size());
    }
    released_after_.resize(links_.size());
    for (size_t slot = num_inputs_; slot < num_slots_; ++slot)
      if (last_reader[slot] >= 0 && last_reader[slot] < static_cast<int64_t>(links_.size()))
        released_after_[last_reader[slot]].push_back(static_cast<int32_t>(slot));
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    KILN_ASSERT_EQ(inputs.size(), num_inputs_) << "inputs of a chained graph";
    std::vector<at::Tensor> slots(num_slots_);
    std::copy(inputs.begin(), inputs.end(), slots.begin());
    size_t next = num_inputs_;
    for (size_t i = 0; i < links_.size(); ++i) {
      const ChainLink& link = links_[i];
      std::vector<at::Tensor> link_inputs;
      link_inputs.reserve(link.input_slots.size());
      for (int32_t slot : link.input_slots) link_inputs.push_back(slots[slot]);
      std::vector<at::Tensor> outputs = link.graph->run(link_inputs);
      KILN_ASSERT_EQ(outputs.size(), link.num_outputs) << "outputs of chain link " << i;
      for (at::Tensor& out : outputs) slots[next++] = std::move(out);
      for (int32_t slot : released_after_[i]) slots[slot].reset();
    }
    std::vector<at::Tensor> results;
    results.reserve(output_slots_.size());
    for (int32_t slot : output_slots_) results.push_back(slots[slot]);
    return results;
  }

  bool reenters_python() const override {
    return std::any_of(links_.begin(), links_.end(), [](const ChainLink& l) { return l.graph->reenters_python(); });
  }

  std::string cudagraph_status() const override {
    std::string status;
    for (size_t i = 0; i < links_.size(); ++i) {
      const std::string part = links_[i].graph->cudagraph_status();
      if (!part.empty()) status += (status.empty() ? "" : "; ") + ("piece " + std::to_string(i) + ": " + part);
    }
    return status;
  }

 private:
  std::vector<ChainLink> links_;
  size_t num_inputs_ = 0;
  size_t num_slots_ = 0;
  std::vector<int32_t> output_slots_;
  std::vector<std::vector<int32_t>> released_after_;
};

}  // namespace

std::shared_ptr<CompiledGraph> make_chained_graph(std::vector<ChainLink> links, size_t num_inputs,
                                                  std::vector<int32_t> output_slots) {
  return std::make_shared<ChainedGraph>(std::move(links), num_inputs, std::move(output_slots));
}

}  // namespace kiln::runtime
