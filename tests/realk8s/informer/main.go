// informer for mvproxy's real-Kubernetes tests: a client-go shared informer on one
// resource (any group/version/resource, through the dynamic client), reached through
// one kubeconfig context, that prints what it sees as JSON lines on stdout, so a test
// can check that an informer behind mvproxy misses nothing.
//
//	informer --kubeconfig K --context C --group admissionregistration.k8s.io \
//	    --version v1 --resource mutatingadmissionpolicies [--namespace NS]
//
// It runs until SIGTERM or SIGINT, until --duration has passed, or, with
// --exit-on-stdin-eof, until its stdin is closed (a test that dies closes the pipe,
// so no informer outlives it). --namespace "" (the default) watches every namespace;
// the context's own namespace is not used.
//
// Each line is one JSON object, written with a single write (stdout is not
// buffered), with "type" and "ts" (RFC 3339, UTC) and:
//
//	ADDED     name, namespace, uid, resourceVersion, initialList (true while the
//	          informer fills its cache from the first list or watch-list)
//	MODIFIED  the same plus oldResourceVersion
//	DELETED   the same plus finalStateUnknown (the informer missed the deletion and
//	          learned of it from a later list)
//	SYNCED    once, when the cache has synced: resourceVersion, items
//	ERROR     what the reflector handed to its watch error handler (a failed list,
//	          a watch that ended in error): error, and code, reason when the error
//	          carries a Kubernetes Status (404 for a resource the server does not
//	          serve). The informer keeps retrying after each.
//	LIST      each list request: resourceVersion asked for, then returned
//	          (listResourceVersion) and items, or error, code, reason
//	WATCH     each watch request: resourceVersion, sendInitialEvents (client-go's
//	          watch-list), timeoutSeconds, or error, code, reason when it could not
//	          start. Connection refused and 429 are retried by the reflector without
//	          reaching ERROR, so only these lines show them.
//	WATCH_ERROR  an ERROR event inside a watch stream (e.g. 410 Expired): code,
//	          reason, message; never the one client-go makes up when the informer
//	          itself cancels the watch as it stops
//	WATCH_END the stream of a watch ended; stoppedByClient is false when the server
//	          or the connection ended it
//	BOOKMARK  with --bookmarks only: resourceVersion, initialEventsEnd
//	STOPPED   last line: reason (signal, stdin, duration, sync-timeout)
//
// With --informers N (N > 1) it runs N informers on the resource, each with its own
// reflector (its own list and watch), all through one client: over HTTP/2 they share
// one connection, as a controller's informers do. In --label-selector and
// --field-selector, {i} becomes the informer's index (0 to N-1), so N watches of the
// same resource can differ. Every line one of them writes carries "informer" (its
// index), SYNCED comes once per informer, and STOPPED once for all.
//
// --version-first asks GET /version (a SERVER_VERSION line: gitVersion) before any
// informer starts, as a controller's discovery does. Without it, informers started
// at once find no connection open, and Go's transport dials one per request (then
// keeps one or two of them for HTTP/2 and closes the rest).
//
// With --objects the event lines also carry the whole object. ADDED, MODIFIED and
// DELETED come from the informer's handler in the informer's order; the request lines
// come from the reflector's goroutine and may be interleaved with them a little out of
// order. Errors before the informer starts (flags, kubeconfig) are an ERROR line and
// exit status 1; --sync-timeout expiring is exit status 1 too; every other end is 0.
//
// client-go's own switches stay available: KUBE_FEATURE_WatchListClient=false turns
// the watch-list off (client-go reads KUBE_FEATURE_<gate> from the environment), and
// klog's flags (--v=4) log the reflector on stderr. --client-go-version prints the
// k8s.io modules linked in and exits.
//
// Built by scripts/kube_binaries.py (python3 scripts/dev.py kube-binaries) with
// k8s.io/client-go at each Kubernetes version's v0.Y.Z; not a module here: the go.mod
// is generated in the cache.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// The modules --client-go-version reports, in this order.
var linkedModules = []string{"k8s.io/client-go", "k8s.io/apimachinery", "k8s.io/api"}

const initialEventsEnd = "k8s.io/initial-events-end"

// out writes one JSON line per call; safe from any goroutine. One made by tagged
// adds its fields to every line and writes through the out it was made from.
type out struct {
	mu     sync.Mutex
	w      io.Writer
	parent *out
	fields map[string]any
}

// tagged: an out whose lines also carry fields (one informer's index among several).
func (o *out) tagged(fields map[string]any) *out {
	return &out{parent: o, fields: fields}
}

func (o *out) emit(kind string, fields map[string]any) {
	if o.parent != nil {
		merged := make(map[string]any, len(o.fields)+len(fields))
		for k, v := range o.fields {
			merged[k] = v
		}
		for k, v := range fields {
			merged[k] = v
		}
		o.parent.emit(kind, merged)
		return
	}
	line := map[string]any{"type": kind, "ts": time.Now().UTC().Format(time.RFC3339Nano)}
	for k, v := range fields {
		line[k] = v
	}
	var data bytes.Buffer
	encoder := json.NewEncoder(&data) // one line, '\n' included; URLs in errors kept readable
	encoder.SetEscapeHTML(false)
	if err := encoder.Encode(line); err != nil {
		data.Reset()
		_ = encoder.Encode(map[string]any{"type": "ERROR", "error": "encoding a line: " + err.Error()})
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	_, _ = o.w.Write(data.Bytes())
}

// errorFields: the error's text, plus code and reason when it carries a Status.
func errorFields(err error, fields map[string]any) map[string]any {
	if fields == nil {
		fields = map[string]any{}
	}
	fields["error"] = err.Error()
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		s := status.Status()
		fields["code"] = s.Code
		fields["reason"] = string(s.Reason)
	}
	return fields
}

// objectFields: what an event line says about one object (or a tombstone's).
func objectFields(obj any, withObject bool) map[string]any {
	fields := map[string]any{}
	if tombstone, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		fields["finalStateUnknown"] = true
		obj = tombstone.Obj
	}
	accessor, err := meta.Accessor(obj)
	if err != nil {
		fields["error"] = err.Error()
		return fields
	}
	fields["name"] = accessor.GetName()
	fields["namespace"] = accessor.GetNamespace()
	fields["uid"] = string(accessor.GetUID())
	fields["resourceVersion"] = accessor.GetResourceVersion()
	if u, ok := obj.(*unstructured.Unstructured); ok && withObject {
		fields["object"] = u.Object
	}
	return fields
}

// observedClient is the dynamic client with every list and watch reported; the
// dynamic informer calls Resource(gvr).Namespace(ns).List/Watch.
type observedClient struct {
	dynamic.Interface
	o         *out
	bookmarks bool
}

func (c observedClient) Resource(gvr schema.GroupVersionResource) dynamic.NamespaceableResourceInterface {
	inner := c.Interface.Resource(gvr)
	return observedResource{NamespaceableResourceInterface: inner,
		lw: observer{inner, c.o, c.bookmarks}}
}

type observedResource struct {
	dynamic.NamespaceableResourceInterface
	lw observer
}

func (r observedResource) Namespace(ns string) dynamic.ResourceInterface {
	inner := r.NamespaceableResourceInterface.Namespace(ns)
	return observedNamespace{ResourceInterface: inner, lw: observer{inner, r.lw.o, r.lw.bookmarks}}
}

func (r observedResource) List(ctx context.Context, opts metav1.ListOptions) (*unstructured.UnstructuredList, error) {
	return r.lw.list(ctx, opts)
}

func (r observedResource) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	return r.lw.watch(ctx, opts)
}

type observedNamespace struct {
	dynamic.ResourceInterface
	lw observer
}

func (r observedNamespace) List(ctx context.Context, opts metav1.ListOptions) (*unstructured.UnstructuredList, error) {
	return r.lw.list(ctx, opts)
}

func (r observedNamespace) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	return r.lw.watch(ctx, opts)
}

// lister is the part of a dynamic resource client the observer wraps.
type lister interface {
	List(ctx context.Context, opts metav1.ListOptions) (*unstructured.UnstructuredList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

type observer struct {
	inner     lister
	o         *out
	bookmarks bool
}

func (w observer) list(ctx context.Context, opts metav1.ListOptions) (*unstructured.UnstructuredList, error) {
	result, err := w.inner.List(ctx, opts)
	fields := map[string]any{"resourceVersion": opts.ResourceVersion}
	if err != nil {
		w.o.emit("LIST", errorFields(err, fields))
		return result, err
	}
	fields["listResourceVersion"] = result.GetResourceVersion()
	fields["items"] = len(result.Items)
	w.o.emit("LIST", fields)
	return result, nil
}

func (w observer) watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	inner, err := w.inner.Watch(ctx, opts)
	fields := map[string]any{"resourceVersion": opts.ResourceVersion,
		"sendInitialEvents": opts.SendInitialEvents != nil && *opts.SendInitialEvents}
	if opts.TimeoutSeconds != nil {
		fields["timeoutSeconds"] = *opts.TimeoutSeconds
	}
	if err != nil {
		w.o.emit("WATCH", errorFields(err, fields))
		return inner, err
	}
	w.o.emit("WATCH", fields)
	return newObservedWatch(ctx, inner, w.o, w.bookmarks), nil
}

// observedWatch passes a watch's events on, reporting error events, bookmarks (if
// asked) and the end of the stream.
//
// ctx is the context the watch request was made with (the reflector's). When the
// informer stops, the reflector cancels it: the response body's read fails with
// "context canceled", and client-go's stream watcher turns that read error into an
// Error event ("unable to decode an event from the watch stream: context canceled",
// a 500 InternalError) unless the reflector's Stop() wins the race. That event is the
// client's own cancellation, not something the server sent, so it is not reported
// as WATCH_ERROR, and the stream's end counts as stopped by the client.
type observedWatch struct {
	ctx       context.Context
	inner     watch.Interface
	events    chan watch.Event
	stopped   chan struct{}
	stopOnce  sync.Once
	o         *out
	bookmarks bool
}

func newObservedWatch(ctx context.Context, inner watch.Interface, o *out, bookmarks bool) *observedWatch {
	observed := &observedWatch{ctx: ctx, inner: inner, events: make(chan watch.Event),
		stopped: make(chan struct{}), o: o, bookmarks: bookmarks}
	go observed.pump()
	return observed
}

func (w *observedWatch) ResultChan() <-chan watch.Event { return w.events }

func (w *observedWatch) Stop() {
	w.stopOnce.Do(func() { close(w.stopped) })
	w.inner.Stop()
}

// isStopped: the client ended this watch (Stop, or the request's context cancelled).
func (w *observedWatch) isStopped() bool {
	select {
	case <-w.stopped:
		return true
	default:
		return w.ctx.Err() != nil
	}
}

func (w *observedWatch) pump() {
	defer close(w.events)
	for event := range w.inner.ResultChan() {
		w.report(event)
		select {
		case w.events <- event:
		case <-w.stopped:
			for range w.inner.ResultChan() {
			}
			w.o.emit("WATCH_END", map[string]any{"stoppedByClient": true})
			return
		}
	}
	w.o.emit("WATCH_END", map[string]any{"stoppedByClient": w.isStopped()})
}

func (w *observedWatch) report(event watch.Event) {
	switch event.Type {
	case watch.Error:
		if w.ctx.Err() != nil {
			return // the client cancelled the request; see observedWatch
		}
		fields := map[string]any{}
		if status, ok := event.Object.(*metav1.Status); ok {
			fields["code"] = status.Code
			fields["reason"] = string(status.Reason)
			fields["message"] = status.Message
		} else if err := apierrors.FromObject(event.Object); err != nil {
			fields = errorFields(err, fields)
		}
		w.o.emit("WATCH_ERROR", fields)
	case watch.Bookmark:
		if !w.bookmarks {
			return
		}
		fields := map[string]any{}
		if accessor, err := meta.Accessor(event.Object); err == nil {
			fields["resourceVersion"] = accessor.GetResourceVersion()
			fields["initialEventsEnd"] = accessor.GetAnnotations()[initialEventsEnd] == "true"
		}
		w.o.emit("BOOKMARK", fields)
	}
}

// linked: "module version" of each of linkedModules as built in (replacements shown).
func linked() []string {
	info, ok := debug.ReadBuildInfo()
	found := map[string]string{}
	if ok {
		for _, dep := range info.Deps {
			version := dep.Version
			if dep.Replace != nil {
				version = dep.Replace.Version
			}
			found[dep.Path] = version
		}
	}
	lines := make([]string, 0, len(linkedModules))
	for _, path := range linkedModules {
		version := found[path]
		if version == "" {
			version = "unknown"
		}
		lines = append(lines, path+" "+version)
	}
	return lines
}

type options struct {
	kubeconfig, context                 string
	group, version, resource, namespace string
	labelSelector, fieldSelector        string
	userAgent                           string
	duration, resync, syncTimeout       time.Duration
	informers                           int
	exitOnStdinEOF, bookmarks, objects  bool
	versionFirst                        bool
	printVersion                        bool
}

func parseFlags() options {
	var opts options
	klog.InitFlags(nil)
	flag.StringVar(&opts.kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)")
	flag.StringVar(&opts.context, "context", "", "kubeconfig context (default: the current context)")
	flag.StringVar(&opts.group, "group", "", "API group (\"\" for the core group)")
	flag.StringVar(&opts.version, "version", "v1", "API version")
	flag.StringVar(&opts.resource, "resource", "", "resource, plural (required), e.g. configmaps")
	flag.StringVar(&opts.namespace, "namespace", "", "namespace to watch (default: all namespaces)")
	flag.StringVar(&opts.labelSelector, "label-selector", "", "label selector for the list and watch")
	flag.StringVar(&opts.fieldSelector, "field-selector", "", "field selector for the list and watch")
	flag.StringVar(&opts.userAgent, "user-agent", "", "User-Agent (default: mvproxy-informer/<client-go version> (<os>/<arch>))")
	flag.DurationVar(&opts.duration, "duration", 0, "stop after this long (0: run until a signal)")
	flag.DurationVar(&opts.resync, "resync", 0, "informer resync period (0: never)")
	flag.IntVar(&opts.informers, "informers", 1, "run this many informers on the resource through one client; {i} in the selectors becomes each one's index")
	flag.DurationVar(&opts.syncTimeout, "sync-timeout", 0, "stop with exit status 1 if the cache has not synced by then (0: wait)")
	flag.BoolVar(&opts.exitOnStdinEOF, "exit-on-stdin-eof", false, "stop when stdin is closed")
	flag.BoolVar(&opts.bookmarks, "bookmarks", false, "report watch bookmarks")
	flag.BoolVar(&opts.objects, "objects", false, "include the whole object in ADDED, MODIFIED and DELETED lines")
	flag.BoolVar(&opts.versionFirst, "version-first", false, "GET /version once before the informers start (one connection for all of them)")
	flag.BoolVar(&opts.printVersion, "client-go-version", false, "print the k8s.io modules linked in and exit")
	flag.Parse()
	return opts
}

func main() {
	os.Exit(run(parseFlags(), &out{w: os.Stdout}))
}

func run(opts options, o *out) int {
	if opts.printVersion {
		for _, line := range linked() {
			fmt.Println(line)
		}
		return 0
	}
	fail := func(err error) int {
		o.emit("ERROR", errorFields(err, nil))
		return 1
	}
	if opts.resource == "" || opts.version == "" || flag.NArg() > 0 {
		return fail(errors.New("usage: informer --resource R [--group G] [--version V] (see --help)"))
	}
	if opts.informers < 1 {
		return fail(errors.New("--informers must be at least 1"))
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = opts.kubeconfig
	config, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules,
		&clientcmd.ConfigOverrides{CurrentContext: opts.context}).ClientConfig()
	if err != nil {
		return fail(fmt.Errorf("kubeconfig: %w", err))
	}
	config.UserAgent = opts.userAgent
	if config.UserAgent == "" {
		config.UserAgent = fmt.Sprintf("mvproxy-informer/%s (%s/%s)",
			linkedVersion("k8s.io/client-go"), runtime.GOOS, runtime.GOARCH)
	}
	httpClient, err := rest.HTTPClientFor(config)
	if err != nil {
		return fail(fmt.Errorf("HTTP client: %w", err))
	}
	client, err := dynamic.NewForConfigAndClient(config, httpClient)
	if err != nil {
		return fail(fmt.Errorf("dynamic client: %w", err))
	}
	if opts.versionFirst {
		discoveryClient, err := discovery.NewDiscoveryClientForConfigAndClient(config, httpClient)
		if err != nil {
			return fail(fmt.Errorf("discovery client: %w", err))
		}
		info, err := discoveryClient.ServerVersion()
		if err != nil {
			return fail(fmt.Errorf("server version: %w", err))
		}
		o.emit("SERVER_VERSION", map[string]any{"gitVersion": info.GitVersion})
	}

	ctx, end, reason := stopContext(opts)
	defer end("done")

	gvr := schema.GroupVersionResource{Group: opts.group, Version: opts.version, Resource: opts.resource}
	informers := make([]cache.SharedIndexInformer, opts.informers)
	outs := make([]*out, opts.informers)
	for i := range informers {
		outs[i] = o
		if opts.informers > 1 {
			outs[i] = o.tagged(map[string]any{"informer": i})
		}
		informer, err := newInformer(client, gvr, opts, i, outs[i])
		if err != nil {
			return fail(err)
		}
		informers[i] = informer
	}

	informerStop := make(chan struct{})
	var running sync.WaitGroup
	for _, informer := range informers {
		running.Add(1)
		go func() {
			defer running.Done()
			informer.Run(informerStop)
		}()
	}
	ran := make(chan struct{})
	go func() {
		running.Wait()
		close(ran)
	}()

	code := 0
	syncCtx := ctx
	if opts.syncTimeout > 0 {
		var cancel context.CancelFunc
		syncCtx, cancel = context.WithTimeout(ctx, opts.syncTimeout)
		defer cancel()
	}
	if waitForSyncs(syncCtx, informers, outs) {
		<-ctx.Done()
	} else if ctx.Err() == nil {
		end("sync-timeout")
		code = 1
	}
	close(informerStop)
	select {
	case <-ran:
	case <-time.After(5 * time.Second):
	}
	o.emit("STOPPED", map[string]any{"reason": reason()})
	return code
}

// newInformer: informer i of opts.informers on gvr, reporting to o; {i} in the
// selectors is its index.
func newInformer(client dynamic.Interface, gvr schema.GroupVersionResource, opts options,
	i int, o *out) (cache.SharedIndexInformer, error) {
	index := strconv.Itoa(i)
	labelSelector := strings.ReplaceAll(opts.labelSelector, "{i}", index)
	fieldSelector := strings.ReplaceAll(opts.fieldSelector, "{i}", index)
	tweak := func(list *metav1.ListOptions) {
		if labelSelector != "" {
			list.LabelSelector = labelSelector
		}
		if fieldSelector != "" {
			list.FieldSelector = fieldSelector
		}
	}
	informer := dynamicinformer.NewFilteredDynamicInformer(
		observedClient{Interface: client, o: o, bookmarks: opts.bookmarks},
		gvr, opts.namespace, opts.resync, cache.Indexers{}, tweak).Informer()
	if err := informer.SetWatchErrorHandler(func(_ *cache.Reflector, err error) {
		o.emit("ERROR", errorFields(err, nil))
	}); err != nil {
		return nil, err
	}
	event := func(kind string, obj any, extra map[string]any) {
		fields := objectFields(obj, opts.objects)
		for k, v := range extra {
			fields[k] = v
		}
		o.emit(kind, fields)
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		AddFunc: func(obj any, initialList bool) {
			event("ADDED", obj, map[string]any{"initialList": initialList})
		},
		UpdateFunc: func(old, obj any) {
			extra := map[string]any{}
			if accessor, err := meta.Accessor(old); err == nil {
				extra["oldResourceVersion"] = accessor.GetResourceVersion()
			}
			event("MODIFIED", obj, extra)
		},
		DeleteFunc: func(obj any) {
			extra := map[string]any{}
			if _, ok := obj.(cache.DeletedFinalStateUnknown); !ok {
				extra["finalStateUnknown"] = false
			}
			event("DELETED", obj, extra)
		},
	}); err != nil {
		return nil, err
	}
	return informer, nil
}

// waitForSyncs: each informer's SYNCED line as its cache syncs; true once all have,
// false if ctx ends first.
func waitForSyncs(ctx context.Context, informers []cache.SharedIndexInformer, outs []*out) bool {
	results := make(chan bool, len(informers))
	for i, informer := range informers {
		go func() {
			synced := cache.WaitForCacheSync(ctx.Done(), informer.HasSynced)
			if synced {
				outs[i].emit("SYNCED", map[string]any{
					"resourceVersion": informer.LastSyncResourceVersion(),
					"items":           len(informer.GetStore().ListKeys())})
			}
			results <- synced
		}()
	}
	all := true
	for range informers {
		all = <-results && all
	}
	return all
}

func linkedVersion(path string) string {
	for _, line := range linked() {
		if len(line) > len(path) && line[:len(path)+1] == path+" " {
			return line[len(path)+1:]
		}
	}
	return "unknown"
}

// stopContext: done on SIGTERM or SIGINT, after --duration, or (with
// --exit-on-stdin-eof) when stdin is closed, or when end is called; reason (to be
// read once the context is done) says which came first.
func stopContext(opts options) (context.Context, func(string), func() string) {
	ctx, cancel := context.WithCancel(context.Background())
	var once sync.Once
	var why string
	end := func(reason string) {
		once.Do(func() {
			why = reason
			cancel()
		})
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		select {
		case <-signals:
			end("signal")
		case <-ctx.Done():
		}
	}()
	if opts.duration > 0 {
		timer := time.AfterFunc(opts.duration, func() { end("duration") })
		context.AfterFunc(ctx, func() { timer.Stop() })
	}
	if opts.exitOnStdinEOF {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			end("stdin")
		}()
	}
	context.AfterFunc(ctx, func() { signal.Stop(signals) })
	return ctx, end, func() string { <-ctx.Done(); return why }
}
