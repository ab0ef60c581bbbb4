// Facts about GPT-2's vocabulary shared by the tokenizer, llm.c token files and
// corpus preparation, so none of them needs the others to know them.
#ifndef SHARDTRAIN_CORE_DATA_GPT2_VOCAB_H_
#define SHARDTRAIN_CORE_DATA_GPT2_VOCAB_H_

namespace shardtrain {

// 256 byte tokens + 50,000 merges + <|endoftext|>.
inline constexpr int kGpt2VocabSize = 50257;

// The document delimiter; llm.c puts it before every document.
inline constexpr int kGpt2EndOfText = 50256;
inline constexpr char kGpt2EndOfTextString[] = "<|endoftext|>";

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_GPT2_VOCAB_H_
