// Package foreigntask defines an analyzer that finds asynq tasks built by
// asynq.NewTask or asynq.NewTaskWithHeaders on their way to caughtup's
// asynq client, before they reach it in production.
//
// caughtupasynq.Client refuses such a task with caughtupasynq.ErrForeignTask
// whenever the context carries a token: asynq v0.26 cannot give back the
// options a task was built with, so the client could stamp it only by
// dropping them. A code base that adopts caughtup finds its existing
// asynq.NewTask call sites with
//
//	$ go install github.com/caughtup/caughtup/cmd/caughtupvet@latest
//	$ go vet -vettool=$(which caughtupvet) ./...
//
// and builds those tasks with caughtupasynq.NewTask instead (the same
// arguments, the context first).
//
// The analyzer follows a task from where it is built to the client's
// EnqueueContext or EnqueueToken: through local variables (a task built in
// one branch of several counts), closures, and the parameters and results
// of functions in any package of the program (as facts, so that a helper
// in one package that builds a task, or one that enqueues it, is seen from
// another). It reports what it can prove: a task that reaches the client
// from somewhere it cannot follow (a struct field, a map, a channel, an
// interface holding the client) is not reported.
package foreigntask

import (
	"fmt"
	"go/token"
	"go/types"
	"slices"
	"strings"

	"golang.org/x/tools/go/analysis"
	"golang.org/x/tools/go/analysis/passes/buildssa"
	"golang.org/x/tools/go/ssa"
)

// Analyzer reports each call that hands caughtup's asynq client a task
// built by asynq.NewTask or asynq.NewTaskWithHeaders.
var Analyzer = &analysis.Analyzer{
	Name: "foreigntask",
	Doc: `report asynq tasks built by asynq.NewTask that reach caughtupasynq.Client

caughtupasynq.Client refuses a task built by asynq.NewTask or
asynq.NewTaskWithHeaders (ErrForeignTask) whenever the context carries a
token, because asynq cannot give back the task's options. Build such tasks
with caughtupasynq.NewTask or caughtupasynq.NewTaskWithHeaders: the same
arguments, the context first.`,
	URL:       "https://pkg.go.dev/github.com/caughtup/caughtup/asynq/caughtupasynq/foreigntask",
	Requires:  []*analysis.Analyzer{buildssa.Analyzer},
	FactTypes: []analysis.Fact{new(BuildsForeign), new(Enqueues)},
	Run:       run,
}

const (
	asynqPath  = "github.com/hibiken/asynq"
	clientPath = "github.com/caughtup/caughtup/asynq/caughtupasynq"
)

// ClientMethods are the methods of *caughtupasynq.Client that enqueue the
// task they are given (the *asynq.Task parameter).
var ClientMethods = []string{"EnqueueContext", "EnqueueToken"}

// BuildsForeign is the fact of a function that returns a task built by
// asynq.NewTask or asynq.NewTaskWithHeaders: Results are the indexes of
// those results, Origin where the task is built.
type BuildsForeign struct {
	Results []int
	Origin  string
}

func (*BuildsForeign) AFact() {}

func (f *BuildsForeign) String() string {
	return fmt.Sprintf("buildsForeign%v", f.Results)
}

// Enqueues is the fact of a function that hands the task of some of its
// parameters (Params, indexes in the signature, the receiver not counted)
// to caughtup's asynq client.
type Enqueues struct {
	Params []int
}

func (*Enqueues) AFact() {}

func (f *Enqueues) String() string { return fmt.Sprintf("enqueues%v", f.Params) }

// origin is what the analyzer knows of where a task value comes from.
type origin struct {
	foreign string           // where a foreign task is built ("" if none is known)
	params  []*ssa.Parameter // parameters the value may be
}

func run(pass *analysis.Pass) (any, error) {
	if pass.Pkg.Path() == clientPath {
		return nil, nil // caughtupasynq's own tasks are the stamped kind
	}
	funcs := pass.ResultOf[buildssa.Analyzer].(*buildssa.SSA).SrcFuncs
	a := &analyzer{pass: pass, builds: map[*ssa.Function][]int{}, origins: map[*ssa.Function]string{}, enqueues: map[*ssa.Function][]int{}}
	// Facts of this package's functions reach a fixed point: each round
	// can only add results and parameters, of which there are finitely
	// many.
	for changed := true; changed; {
		changed = false
		for _, fn := range funcs {
			if a.summarize(fn) {
				changed = true
			}
		}
	}
	for _, fn := range funcs {
		if obj, ok := fn.Object().(*types.Func); ok && obj.Pkg() == pass.Pkg {
			if r := a.builds[fn]; len(r) > 0 {
				pass.ExportObjectFact(obj, &BuildsForeign{Results: r, Origin: a.origins[fn]})
			}
			if p := a.enqueues[fn]; len(p) > 0 {
				pass.ExportObjectFact(obj, &Enqueues{Params: p})
			}
		}
	}
	for _, fn := range funcs {
		a.report(fn)
	}
	return nil, nil
}

type analyzer struct {
	pass     *analysis.Pass
	builds   map[*ssa.Function][]int  // result indexes that are foreign tasks
	origins  map[*ssa.Function]string // where those are built
	enqueues map[*ssa.Function][]int  // parameters that reach the client
}

// summarize updates fn's results and parameters; it reports whether
// either grew.
func (a *analyzer) summarize(fn *ssa.Function) bool {
	changed := false
	for _, b := range fn.Blocks {
		for _, instr := range b.Instrs {
			switch in := instr.(type) {
			case *ssa.Return:
				for i, v := range in.Results {
					if !isTask(v.Type()) {
						continue
					}
					if o := a.origin(v, map[ssa.Value]bool{}); o.foreign != "" && !slices.Contains(a.builds[fn], i) {
						a.builds[fn] = append(a.builds[fn], i)
						a.origins[fn] = o.foreign
						changed = true
					}
				}
			case ssa.CallInstruction:
				for _, arg := range a.sinks(in.Common()) {
					for _, p := range a.origin(arg, map[ssa.Value]bool{}).params {
						// A closure's captured parameter is its
						// enclosing function's.
						owner, i := p.Parent(), paramIndex(p)
						if i >= 0 && !slices.Contains(a.enqueues[owner], i) {
							a.enqueues[owner] = append(a.enqueues[owner], i)
							changed = true
						}
					}
				}
			}
		}
	}
	return changed
}

// report reports the calls of fn that hand the client a foreign task.
func (a *analyzer) report(fn *ssa.Function) {
	for _, b := range fn.Blocks {
		for _, instr := range b.Instrs {
			call, ok := instr.(ssa.CallInstruction)
			if !ok {
				continue
			}
			for _, arg := range a.sinks(call.Common()) {
				o := a.origin(arg, map[ssa.Value]bool{})
				if o.foreign == "" {
					continue
				}
				pos := call.Pos()
				if pos == token.NoPos {
					pos = fn.Pos()
				}
				a.pass.Reportf(pos, "task built by %s reaches caughtupasynq.Client, which refuses it (ErrForeignTask) when the context carries a token: build it with caughtupasynq.NewTask(ctx, ...) or caughtupasynq.NewTaskWithHeaders", o.foreign)
			}
		}
	}
}

// sinks returns the arguments of a call that reach the client as tasks:
// the task of Client's enqueue methods, and the parameters of functions
// known to enqueue theirs.
func (a *analyzer) sinks(c *ssa.CallCommon) []ssa.Value {
	callee := c.StaticCallee()
	if callee == nil {
		return nil
	}
	args := c.Args
	sig := callee.Signature
	if sig.Recv() != nil {
		args = args[1:] // the receiver
	}
	var params []int
	if isClientMethod(callee) {
		for i := range sig.Params().Len() {
			if isTask(sig.Params().At(i).Type()) {
				params = append(params, i)
			}
		}
	} else if fn := calleeFunc(callee); fn != nil {
		params = a.enqueuesOf(callee, fn)
	}
	var out []ssa.Value
	for _, i := range params {
		if i < len(args) {
			out = append(out, args[i])
		}
	}
	return out
}

// enqueuesOf returns the parameters of callee that reach the client.
func (a *analyzer) enqueuesOf(callee *ssa.Function, obj *types.Func) []int {
	if obj.Pkg() == a.pass.Pkg {
		return a.enqueues[callee]
	}
	var f Enqueues
	if a.pass.ImportObjectFact(obj, &f) {
		return f.Params
	}
	return nil
}

// buildsOf returns the results of callee that are foreign tasks, and where
// they are built.
func (a *analyzer) buildsOf(callee *ssa.Function) ([]int, string) {
	if isNewTask(callee) {
		return []int{0}, fmt.Sprintf("asynq.%s at %s", callee.Name(), "%s")
	}
	obj := calleeFunc(callee)
	if obj == nil {
		return nil, ""
	}
	if obj.Pkg() == a.pass.Pkg {
		return a.builds[callee], a.origins[callee]
	}
	var f BuildsForeign
	if a.pass.ImportObjectFact(obj, &f) {
		return f.Results, f.Origin
	}
	return nil, ""
}

// origin follows v back to where it is made.
func (a *analyzer) origin(v ssa.Value, seen map[ssa.Value]bool) origin {
	if seen[v] {
		return origin{}
	}
	seen[v] = true
	switch v := v.(type) {
	case *ssa.Call:
		if res, where := a.buildsOf(calleeOf(v.Common())); slices.Contains(res, 0) {
			return origin{foreign: a.where(where, v.Pos())}
		}
	case *ssa.Extract:
		if call, ok := v.Tuple.(*ssa.Call); ok {
			if res, where := a.buildsOf(calleeOf(call.Common())); slices.Contains(res, v.Index) {
				return origin{foreign: a.where(where, call.Pos())}
			}
		}
	case *ssa.Phi:
		var out origin
		for _, e := range v.Edges {
			out = merge(out, a.origin(e, seen))
		}
		return out
	case *ssa.Parameter:
		return origin{params: []*ssa.Parameter{v}}
	case *ssa.UnOp:
		if v.Op == token.MUL { // a load: whatever was stored there
			return a.stored(v.X, seen)
		}
	case *ssa.FreeVar:
		return a.captured(v, seen)
	case *ssa.ChangeType:
		return a.origin(v.X, seen)
	}
	return origin{}
}

// stored merges the origins of the values stored at addr, a local
// variable (an Alloc, or the free variable a closure captured it as).
func (a *analyzer) stored(addr ssa.Value, seen map[ssa.Value]bool) origin {
	switch addr := addr.(type) {
	case *ssa.Alloc:
		var out origin
		for _, r := range *addr.Referrers() {
			if st, ok := r.(*ssa.Store); ok && st.Addr == addr {
				out = merge(out, a.origin(st.Val, seen))
			}
		}
		// Stores made by closures that captured the variable.
		for _, r := range *addr.Referrers() {
			if mc, ok := r.(*ssa.MakeClosure); ok {
				fn := mc.Fn.(*ssa.Function)
				for i, b := range mc.Bindings {
					if b == addr && i < len(fn.FreeVars) {
						out = merge(out, a.storedIn(fn.FreeVars[i], seen))
					}
				}
			}
		}
		return out
	case *ssa.FreeVar:
		if seen[addr] {
			return origin{}
		}
		seen[addr] = true
		return merge(a.captured(addr, seen), a.storedIn(addr, seen))
	}
	return origin{}
}

// storedIn merges the origins of the values a closure stores through its
// free variable fv.
func (a *analyzer) storedIn(fv *ssa.FreeVar, seen map[ssa.Value]bool) origin {
	var out origin
	for _, r := range *fv.Referrers() {
		if st, ok := r.(*ssa.Store); ok && st.Addr == fv {
			out = merge(out, a.origin(st.Val, seen))
		}
	}
	return out
}

// captured is the origin of what the closure's free variable fv was bound
// to where the closure was made.
func (a *analyzer) captured(fv *ssa.FreeVar, seen map[ssa.Value]bool) origin {
	fn := fv.Parent()
	idx := slices.Index(fn.FreeVars, fv)
	parent := fn.Parent()
	if idx < 0 || parent == nil {
		return origin{}
	}
	var out origin
	for _, b := range parent.Blocks {
		for _, instr := range b.Instrs {
			mc, ok := instr.(*ssa.MakeClosure)
			if !ok || mc.Fn != fn || idx >= len(mc.Bindings) {
				continue
			}
			bound := mc.Bindings[idx]
			if _, isPtr := fv.Type().(*types.Pointer); isPtr && !isTask(fv.Type()) {
				out = merge(out, a.stored(bound, seen)) // captured by reference
			} else {
				out = merge(out, a.origin(bound, seen))
			}
		}
	}
	return out
}

// paramIndex is p's index among its function's parameters, the receiver
// not counted, or -1 for the receiver.
func paramIndex(p *ssa.Parameter) int {
	fn := p.Parent()
	i := slices.Index(fn.Params, p)
	if fn.Signature.Recv() != nil {
		i--
	}
	return i
}

// where fills the position into an origin of asynq.NewTask.
func (a *analyzer) where(format string, pos token.Pos) string {
	if !strings.Contains(format, "%s") {
		return format
	}
	p := a.pass.Fset.Position(pos)
	return fmt.Sprintf(format, fmt.Sprintf("%s:%d", shortFile(p.Filename), p.Line))
}

// shortFile is a file name without its directory.
func shortFile(name string) string {
	if i := strings.LastIndexAny(name, `/\`); i >= 0 {
		return name[i+1:]
	}
	return name
}

func merge(a, b origin) origin {
	if a.foreign == "" {
		a.foreign = b.foreign
	}
	for _, p := range b.params {
		if !slices.Contains(a.params, p) {
			a.params = append(a.params, p)
		}
	}
	return a
}

// calleeOf is the function a call statically calls, or nil.
func calleeOf(c *ssa.CallCommon) *ssa.Function { return c.StaticCallee() }

// calleeFunc is the declared function or method fn is, or nil (a closure,
// a wrapper).
func calleeFunc(fn *ssa.Function) *types.Func {
	if fn == nil {
		return nil
	}
	if fn.Origin() != nil {
		fn = fn.Origin()
	}
	obj, _ := fn.Object().(*types.Func)
	return obj
}

// isNewTask reports whether fn is asynq.NewTask or asynq.NewTaskWithHeaders.
func isNewTask(fn *ssa.Function) bool {
	obj := calleeFunc(fn)
	return obj != nil && obj.Pkg() != nil && obj.Pkg().Path() == asynqPath &&
		(obj.Name() == "NewTask" || obj.Name() == "NewTaskWithHeaders")
}

// isClientMethod reports whether fn is one of ClientMethods of
// *caughtupasynq.Client.
func isClientMethod(fn *ssa.Function) bool {
	obj := calleeFunc(fn)
	if obj == nil || obj.Pkg() == nil || obj.Pkg().Path() != clientPath || !slices.Contains(ClientMethods, obj.Name()) {
		return false
	}
	recv := obj.Type().(*types.Signature).Recv()
	if recv == nil {
		return false
	}
	t := recv.Type()
	if p, ok := t.(*types.Pointer); ok {
		t = p.Elem()
	}
	named, ok := t.(*types.Named)
	return ok && named.Obj().Name() == "Client"
}

// isTask reports whether t is *asynq.Task.
func isTask(t types.Type) bool {
	p, ok := t.(*types.Pointer)
	if !ok {
		return false
	}
	named, ok := p.Elem().(*types.Named)
	return ok && named.Obj().Pkg() != nil && named.Obj().Pkg().Path() == asynqPath && named.Obj().Name() == "Task"
}
