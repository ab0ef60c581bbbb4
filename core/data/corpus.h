// A corpus as plain text, before tokenization: what BrownCorpus and
// TextCorpus produce and PrepareDataset consumes.
#ifndef SHARDTRAIN_CORE_DATA_CORPUS_H_
#define SHARDTRAIN_CORE_DATA_CORPUS_H_

#include <string>
#include <vector>

namespace shardtrain {

// The unit that goes wholly to train or to val.
struct Document {
  std::string name;   // "ca01", or the file's path
  std::string group;  // split stratum (a Brown genre); empty for plain text
  std::string text;   // UTF-8, never empty
};

struct Corpus {
  std::string source;               // "brown", or the paths it was read from
  std::vector<Document> documents;  // in a deterministic order
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_CORPUS_H_
