// Package typednil tells a nil interface value from one that holds a nil
// pointer, func, map, slice or channel: what `b, _ := feed.NewBudget(cfg)`
// or `pub, _ := caughtupkafka.NewOutboxPublisher(w)` leaves after a refused
// config. Such a value is != nil, so a config check that compares with nil
// accepts it, and the first method call panics. Configs use Is to refuse it
// up front instead.
package typednil

import "reflect"

// Is reports whether v is nil, or holds a nil pointer, func, map, slice,
// channel or interface.
func Is(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Func, reflect.Map, reflect.Slice, reflect.Chan, reflect.Interface, reflect.UnsafePointer:
		return rv.IsNil()
	}
	return false
}
