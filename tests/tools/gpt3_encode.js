#!/usr/bin/env node
// Encodes strings with the gpt-3-encoder npm package: the JavaScript GPT-2
// tokenizer the C++ BpeTokenizer is tested against.
//
//   node gpt3_encode.js PACKAGE_DIR INPUT.json
//
// PACKAGE_DIR is node_modules/gpt-3-encoder (scripts/setup installs it);
// INPUT.json holds a JSON list of strings. Prints a JSON list holding each
// string's token ids.
'use strict';
const fs = require('fs');
const path = require('path');

const args = process.argv.slice(2);
if (args.length !== 2) {
  console.error('usage: gpt3_encode.js PACKAGE_DIR INPUT.json');
  process.exit(2);
}
const {encode} = require(path.resolve(args[0]));
const texts = JSON.parse(fs.readFileSync(args[1], 'utf-8'));
process.stdout.write(JSON.stringify(texts.map(text => encode(text))));
