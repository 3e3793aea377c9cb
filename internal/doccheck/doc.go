// Package doccheck keeps the documentation's Go code compiling: it finds
// every Go snippet of the module (the ```go blocks of its Markdown files,
// and the code blocks of its library's doc comments), compiles each one as
// a package of the module, and reports each problem at the documentation's
// file and line. TestDocs runs it over the module, so go test ./... (and
// make test, make doccheck) fail when a snippet stops compiling.
//
// A snippet is a Go file's body: imports, types, functions, variables, an
// optional package clause. Statements go in a function whose parameters
// name what they use, so that a reader sees the type of every value and can
// copy the function as it is. Imports a reader would write anyway may be
// left out: a package name of Imports used as a selector (consume.Config)
// and not declared or imported gets its import. Wrap turns a snippet into
// the file that is compiled, with line directives that map every line back
// to the documentation.
//
// Besides compiler errors (parse and type errors, unused variables and
// imports), Check reports:
//
//   - an error a call returns that nothing reads: assigned to _, overwritten
//     before it is read, or dropped with the call's results (fmt.Print,
//     Printf and Println excepted; deferred calls are not counted);
//   - a go statement whose function returns an error, which is lost;
//   - a snippet that is not as gofmt formats it;
//   - a fenced Markdown block without a language (```sh, ```text, ```sql …
//     are not compiled; a bare ``` could hide Go).
//
// A doc-comment code block that is not Go starts with "$ " (a shell
// command) or is listed in NotGo. The doc comments of commands (package
// main: their blocks are usage), of testkit/, chaos/ and examples/ are not
// read: that code is compiled as it is.
//
// Snippets are compiled in memory: go/packages loads each as a package
// under internal/doccheck/snippets/ through an overlay, so nothing is
// written to the module and nothing else sees them; dependencies come from
// the build cache as export data.
package doccheck
